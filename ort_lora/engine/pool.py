"""PagePool: the unified paged pool of S-LoRA, as pure bookkeeping (page ids, refcounts).

Page p is "the p-th KV block of every layer". A page holds either one KV block of one
sequence or a slice of one adapter's weights; ONE free list serves both, so memory flows
between the KV cache and adapters as load changes. This module never touches the memory
itself: it only decides which page ids are used for what.

API (the engine and scheduler call only these):
  can_allocate(n) -> bool       n pages obtainable: free + pages of idle adapters
  can_admit(kv_pages, adapter_id, adapter_pages) -> bool
                                a request's KV pages and its adapter fit together (a resident
                                adapter costs nothing, and it is not counted as evictable)
  can_admit_all(kv_pages, [(adapter_id, adapter_pages), ...]) -> bool
                                the same for a request that runs with several adapters
  allocate_kv(n) -> list[int]   n pages for KV blocks; evicts idle adapters LRU when the free
                                list is short; raises PoolExhausted when impossible (check
                                can_allocate first: a failed call changes nothing)
  free_kv(pages)                return KV pages to the free list
  acquire_adapter(id, n) -> (pages, needs_load)
                                pin the adapter (refcount + 1). Resident: its pages, False
                                (a hit; it becomes most recently used). Not resident: n fresh
                                pages (evicting idle adapters LRU, never a pinned one), True:
                                the caller must copy the weights in before the next run.
                                Raises PoolExhausted when impossible (nothing changes).
  prefetch_adapter(id, n) -> pages | None
                                make a non-resident adapter resident in n FREE pages, idle
                                (never evicts anything for it); None if resident or the free
                                list is short. The caller copies the weights in; a later
                                acquire is a hit
  release_adapter(id)           refcount - 1; the adapter stays resident, idle when 0
  drop_adapter(id) -> bool      free an idle adapter's pages now (unload); False if it is
                                pinned (refcount > 0) or not resident
  is_resident(id), adapter_pages(id), refcount(id)
  free_pages(), kv_pages(), residents() the pages by use (engine/invariants.py checks them)
  stats() -> PoolStats          page counts by use, adapter load/eviction/hit/miss counters

Adapter ids are any hashable value chosen by the engine (e.g. LoRARequest.lora_int_id).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    """The pool cannot provide the pages asked for, even after evicting idle adapters."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool: pages by use (they sum to num_pages) and adapter counters."""

    num_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages_pinned: int
    adapter_pages_idle: int
    resident_adapters: int
    adapter_loads: int  # acquires that allocated pages (the weights must be copied in)
    adapter_evictions: int  # idle adapters whose pages were taken back
    adapter_hits: int  # acquires of a resident adapter
    adapter_misses: int  # acquires of a non-resident adapter (== loads)


@dataclass
class _Resident:
    pages: list[int]
    refcount: int = 0


class PagePool:
    """Free list + KV page set + resident adapters in LRU order (least recent first)."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._kv: set[int] = set()
        self._adapters: OrderedDict[Hashable, _Resident] = OrderedDict()
        self._loads = self._evictions = self._hits = self._misses = 0
        # adapter id -> {"loads", "evictions", "hits", "misses"}: per-adapter /metrics figures
        self.adapter_counters: dict[Hashable, dict[str, int]] = {}

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _evictable(self, keep: Iterable[Hashable] = ()) -> int:
        keep = set(keep)
        return sum(
            len(r.pages) for a, r in self._adapters.items() if r.refcount == 0 and a not in keep
        )

    def can_allocate(self, n: int) -> bool:
        """True if n pages can be obtained (free pages + pages of idle adapters)."""
        return n <= len(self._free) + self._evictable()

    def can_admit(self, kv_pages: int, adapter_id: Hashable | None, adapter_pages: int) -> bool:
        """True if kv_pages KV pages AND the adapter (resident or loaded) fit at once."""
        return self.can_admit_all(
            kv_pages, [] if adapter_id is None else [(adapter_id, adapter_pages)]
        )

    def can_admit_all(self, kv_pages: int, adapters: Iterable[tuple[Hashable, int]]) -> bool:
        """True if kv_pages KV pages AND every (adapter, pages) fit at once (acquire the
        resident ones first: loading the others then evicts none of them)."""
        adapters = list(adapters)
        needed = kv_pages + sum(n for a, n in adapters if a not in self._adapters)
        return needed <= len(self._free) + self._evictable(keep=[a for a, _ in adapters])

    def _take(self, n: int) -> list[int]:
        """n pages off the free list, evicting idle adapters LRU first if it is short."""
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"cannot allocate {n} pages: {len(self._free)} free and "
                f"{self._evictable()} in idle adapters, of {self.num_pages}"
            )
        while len(self._free) < n:
            self._evict_lru()
        return [self._free.popleft() for _ in range(n)]

    def _evict_lru(self) -> None:
        victim = next(a for a, r in self._adapters.items() if r.refcount == 0)
        self._free.extend(self._adapters.pop(victim).pages)
        self._evictions += 1
        self._count(victim, "evictions")

    def _count(self, adapter_id: Hashable, *names: str) -> None:
        counters = self.adapter_counters.setdefault(
            adapter_id, {"loads": 0, "evictions": 0, "hits": 0, "misses": 0}
        )
        for name in names:
            counters[name] += 1

    # ---- KV blocks --------------------------------------------------------------------------

    def allocate_kv(self, n: int) -> list[int]:
        """n pages for KV blocks (may evict idle adapters). Raises PoolExhausted if impossible."""
        pages = self._take(n)
        self._kv.update(pages)
        return pages

    def free_kv(self, pages: Iterable[int]) -> None:
        """Return KV pages to the free list. Raises ValueError for a page not used by KV."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._kv]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"free_kv: pages {bad or pages} are not allocated KV pages")
        self._kv.difference_update(pages)
        self._free.extend(pages)

    # ---- adapters ---------------------------------------------------------------------------

    def acquire_adapter(self, adapter_id: Hashable, num_pages: int) -> tuple[list[int], bool]:
        """Pin an adapter; returns (its pages, needs_load). See the module docstring."""
        resident = self._adapters.get(adapter_id)
        if resident is not None:
            if len(resident.pages) != num_pages:
                raise ValueError(
                    f"adapter {adapter_id!r} is resident with {len(resident.pages)} pages, "
                    f"asked for {num_pages}"
                )
            resident.refcount += 1
            self._adapters.move_to_end(adapter_id)
            self._hits += 1
            self._count(adapter_id, "hits")
            return list(resident.pages), False
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"adapter {adapter_id!r}: num_pages must be >= 1, got {num_pages!r}")
        pages = self._take(num_pages)
        self._adapters[adapter_id] = _Resident(pages, refcount=1)
        self._misses += 1
        self._loads += 1
        self._count(adapter_id, "misses", "loads")
        return list(pages), True

    def prefetch_adapter(self, adapter_id: Hashable, num_pages: int) -> list[int] | None:
        """Make an adapter resident and idle in free pages only; see the module docstring."""
        if adapter_id in self._adapters or num_pages > len(self._free):
            return None
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"adapter {adapter_id!r}: num_pages must be >= 1, got {num_pages!r}")
        pages = [self._free.popleft() for _ in range(num_pages)]
        self._adapters[adapter_id] = _Resident(pages, refcount=0)
        self._loads += 1
        self._count(adapter_id, "loads")
        return list(pages)

    def release_adapter(self, adapter_id: Hashable) -> None:
        """Unpin once; the adapter stays resident (idle and evictable at refcount 0)."""
        resident = self._adapters.get(adapter_id)
        if resident is None or resident.refcount == 0:
            raise ValueError(f"release_adapter: adapter {adapter_id!r} is not pinned")
        resident.refcount -= 1

    def drop_adapter(self, adapter_id: Hashable) -> bool:
        """Free an idle adapter's pages now. False if it is pinned or not resident."""
        resident = self._adapters.get(adapter_id)
        if resident is None or resident.refcount > 0:
            return False
        self._free.extend(self._adapters.pop(adapter_id).pages)
        return True

    def is_resident(self, adapter_id: Hashable) -> bool:
        return adapter_id in self._adapters

    def adapter_pages(self, adapter_id: Hashable) -> list[int]:
        """Pages of a resident adapter (KeyError names it if it is not resident)."""
        if adapter_id not in self._adapters:
            raise KeyError(f"adapter {adapter_id!r} is not resident in the pool")
        return list(self._adapters[adapter_id].pages)

    def refcount(self, adapter_id: Hashable) -> int:
        """Pins held on the adapter (0 if idle or not resident)."""
        resident = self._adapters.get(adapter_id)
        return resident.refcount if resident else 0

    def free_pages(self) -> list[int]:
        return list(self._free)

    def kv_pages(self) -> set[int]:
        return set(self._kv)

    def residents(self) -> dict[Hashable, tuple[list[int], int]]:
        """Resident adapters, least recently used first: id -> (pages, refcount)."""
        return {a: (list(r.pages), r.refcount) for a, r in self._adapters.items()}

    # ---- metrics ----------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        pinned = sum(len(r.pages) for r in self._adapters.values() if r.refcount > 0)
        return PoolStats(
            num_pages=self.num_pages,
            free_pages=len(self._free),
            kv_pages=len(self._kv),
            adapter_pages_pinned=pinned,
            adapter_pages_idle=self._evictable(),
            resident_adapters=len(self._adapters),
            adapter_loads=self._loads,
            adapter_evictions=self._evictions,
            adapter_hits=self._hits,
            adapter_misses=self._misses,
        )
