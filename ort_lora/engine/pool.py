"""PagePool: the unified paged pool of S-LoRA, as pure bookkeeping (page ids, refcounts).

Page p is "the p-th KV block of every layer". A page holds either KV blocks (of the
sequences whose block tables list it) or a slice of one adapter's weights; ONE free list
serves both, so memory flows between the KV cache and adapters as load changes. This module
never touches the memory itself: it only decides which page ids are used for what.

Prefix caching: a full, computed KV block may be registered under its block hash
(cache_block); a later sequence whose prompt starts with the same blocks (same hash chain)
shares those pages read-only (share_kv: reference counted). A cached block no sequence uses
is idle: it keeps its KV for a later hit, and it is evictable like an idle adapter; the two
kinds compete in ONE least-recently-used order (an adapter's use is its last acquire or
release, a block's its last release), so KV growth and admission take pages from them before
anything waits. Every page has exactly one use: free, KV (referenced by >= 1 block table),
cached idle, or adapter.

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
  free_kv(pages)                drop one reference to each KV page: a page nobody references
                                is freed, or kept as an idle cached block if it has a hash
  lookup(hashes) -> list[int]   pages of the longest cached prefix of a chain of block hashes
  share_kv(pages)               one more reference to each (cached) page: a prefix-cache hit
  cache_block(page, hash, tag) -> bool
                                register a full computed KV page under its block hash (tag:
                                the adapter ids its KV depends on); False if that hash is
                                cached already (the page then stays private)
  acquire_adapter(id, n) -> (pages, needs_load)
                                pin the adapter (refcount + 1). Resident: its pages, False
                                (a hit; it becomes most recently used). Not resident: n fresh
                                pages (evicting idle adapters LRU, never a pinned one), True:
                                the caller must copy the weights in before the next run.
                                Raises PoolExhausted when impossible (nothing changes).
  prefetch_adapter(id, n) -> pages | None
                                make a non-resident adapter resident in n free pages, idle
                                (never evicts an adapter for it; idle cached KV blocks, which
                                stand in for free memory, are taken LRU when the free list
                                is short); None if resident or that is not enough. The caller
                                copies the weights in; a later acquire is a hit
  release_adapter(id)           refcount - 1; the adapter stays resident, idle when 0
  drop_adapter(id) -> bool      free an idle adapter's pages now (unload) and uncache the KV
                                blocks tagged with it; False if it is pinned (refcount > 0)
                                or not resident (its blocks are uncached either way)
  is_resident(id), adapter_pages(id), refcount(id)
  free_pages(), kv_pages(), residents(), cached_pages(), kv_refcounts(), block_hashes()
                                the pages by use (engine/invariants.py checks them)
  stats() -> PoolStats          page counts by use, adapter load/eviction/hit/miss counters

Adapter ids are any hashable value chosen by the engine (e.g. LoRARequest.lora_int_id).
"""

from __future__ import annotations

import random
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
    kv_pages: int  # referenced by running sequences (shared prefix pages count once)
    cached_pages: int  # idle cached KV blocks: kept for prefix-cache hits, evictable
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
    last_use: int = 0  # the pool's clock at its last acquire or release


class PagePool:
    """Free list + KV page set + resident adapters in LRU order (least recent first)."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._kv: dict[int, int] = {}  # KV page -> block tables that list it
        self._adapters: OrderedDict[Hashable, _Resident] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}  # cached page -> its block hash
        self._page_of: dict[bytes, int] = {}  # block hash -> its cached page
        self._tag_of: dict[int, tuple] = {}  # cached page -> adapter ids its KV depends on
        self._idle: OrderedDict[int, int] = OrderedDict()  # idle cached page -> last use
        self._clock = 0  # counts uses: the one LRU order of idle adapters and idle blocks
        self._loads = self._evictions = self._hits = self._misses = 0
        # adapter id -> {"loads", "evictions", "hits", "misses"}: per-adapter /metrics figures
        self.adapter_counters: dict[Hashable, dict[str, int]] = {}

    # ---- capacity ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _evictable(self, keep: Iterable[Hashable] = (), keep_pages: Iterable[int] = ()) -> int:
        """Pages of idle adapters (but those in `keep`) and idle cached blocks (but those in
        `keep_pages`)."""
        keep = set(keep)
        adapters = sum(
            len(r.pages) for a, r in self._adapters.items() if r.refcount == 0 and a not in keep
        )
        return adapters + len(self._idle) - sum(1 for p in set(keep_pages) if p in self._idle)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def scatter_free(self, seed: int = 0) -> None:
        """Puts the free pages in a random order (seeded), as they lie in a pool after many
        requests have come and gone: blocks handed out next are then scattered over the pool
        rather than in order (benchmarks: `bench/bench_lora_cost.py --scattered-pages`)."""
        pages = list(self._free)
        random.Random(seed).shuffle(pages)
        self._free = deque(pages)

    def can_allocate(self, n: int) -> bool:
        """True if n pages can be obtained (free pages + pages of idle adapters)."""
        return n <= len(self._free) + self._evictable()

    def can_admit(self, kv_pages: int, adapter_id: Hashable | None, adapter_pages: int) -> bool:
        """True if kv_pages KV pages AND the adapter (resident or loaded) fit at once."""
        return self.can_admit_all(
            kv_pages, [] if adapter_id is None else [(adapter_id, adapter_pages)]
        )

    def can_admit_all(
        self, kv_pages: int, adapters: Iterable[tuple[Hashable, int]], shared: Iterable[int] = ()
    ) -> bool:
        """True if kv_pages new KV pages AND every (adapter, pages) fit at once (acquire the
        resident ones first: loading the others then evicts none of them), the cached pages
        `shared` being shared first (they are then not evictable)."""
        adapters = list(adapters)
        needed = kv_pages + sum(n for a, n in adapters if a not in self._adapters)
        keep = [a for a, _ in adapters]
        return needed <= len(self._free) + self._evictable(keep, shared)

    def _take(self, n: int) -> list[int]:
        """n pages off the free list, evicting idle adapters LRU first if it is short."""
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"cannot allocate {n} pages: {len(self._free)} free and "
                f"{self._evictable()} in idle adapters and cached blocks, of {self.num_pages}"
            )
        while len(self._free) < n:
            self._evict_lru()
        return [self._free.popleft() for _ in range(n)]

    def _evict_lru(self) -> None:
        """Free the least recently used idle adapter or idle cached block."""
        victim = next((a for a, r in self._adapters.items() if r.refcount == 0), None)
        block = next(iter(self._idle.items()), None)
        if victim is None or (block is not None and block[1] < self._adapters[victim].last_use):
            self._uncache(block[0])
            return
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
        """n pages for KV blocks (may evict idle adapters and idle cached blocks, LRU). Raises
        PoolExhausted if impossible."""
        pages = self._take(n)

        self._kv.update(dict.fromkeys(pages, 1))
        return pages

    def free_kv(self, pages: Iterable[int]) -> None:
        """Drop one reference to each KV page (a block table's, in order). A page no table
        lists any more is freed, or kept as an idle cached block if it has a hash (the last
        pages first in the LRU order: a prefix outlives its tails). ValueError for a page not
        used by KV."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._kv]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"free_kv: pages {bad or pages} are not allocated KV pages")
        for p in reversed(pages):
            self._kv[p] -= 1
            if self._kv[p]:
                continue
            del self._kv[p]
            if p in self._hash_of:
                self._idle[p] = self._tick()
            else:
                self._free.append(p)

    # ---- prefix cache -----------------------------------------------------------------------

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Cached pages of the longest prefix of `hashes` (a chain: block i's hash covers
        blocks 0..i) that is in the cache; changes nothing."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def share_kv(self, pages: Iterable[int]) -> None:
        """One more reference to each cached page (a hit: an idle one is in use again)."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._hash_of]
        if bad:
            raise ValueError(f"share_kv: pages {bad} are not cached KV blocks")
        for p in pages:
            self._kv[p] = self._kv.get(p, 0) + 1
            self._idle.pop(p, None)

    def cache_block(self, page: int, block_hash: bytes, tag: tuple = ()) -> bool:
        """Register a full, computed KV page under its block hash; tag: the adapter ids its KV
        depends on (drop_adapter uncaches it). False (nothing changes) if the hash is cached
        already, in another page: this page then stays private to its sequence."""
        if self._kv.get(page, 0) < 1:
            raise ValueError(f"cache_block: page {page} is not an allocated KV page")
        if block_hash in self._page_of or page in self._hash_of:
            return False
        self._hash_of[page], self._page_of[block_hash] = block_hash, page
        self._tag_of[page] = tuple(tag)
        return True

    def _uncache(self, page: int) -> None:
        """Forget a cached page's hash; an idle one is freed (a referenced one is freed when
        its last table lets go of it)."""
        del self._page_of[self._hash_of.pop(page)]
        del self._tag_of[page]
        if self._idle.pop(page, None) is not None:
            self._free.append(page)

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
            resident.last_use = self._tick()
            self._adapters.move_to_end(adapter_id)
            self._hits += 1
            self._count(adapter_id, "hits")
            return list(resident.pages), False
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"adapter {adapter_id!r}: num_pages must be >= 1, got {num_pages!r}")
        pages = self._take(num_pages)
        self._adapters[adapter_id] = _Resident(pages, refcount=1, last_use=self._tick())
        self._misses += 1
        self._loads += 1
        self._count(adapter_id, "misses", "loads")
        return list(pages), True

    def prefetch_adapter(self, adapter_id: Hashable, num_pages: int) -> list[int] | None:
        """Make an adapter resident and idle in free pages (or idle cached blocks'); see the
        module docstring."""
        if adapter_id in self._adapters or num_pages > len(self._free) + len(self._idle):
            return None
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"adapter {adapter_id!r}: num_pages must be >= 1, got {num_pages!r}")
        while len(self._free) < num_pages:
            self._uncache(next(iter(self._idle)))
        pages = [self._free.popleft() for _ in range(num_pages)]
        self._adapters[adapter_id] = _Resident(pages, refcount=0, last_use=self._tick())
        self._loads += 1
        self._count(adapter_id, "loads")
        return list(pages)

    def release_adapter(self, adapter_id: Hashable) -> None:
        """Unpin once; the adapter stays resident (idle and evictable at refcount 0)."""
        resident = self._adapters.get(adapter_id)
        if resident is None or resident.refcount == 0:
            raise ValueError(f"release_adapter: adapter {adapter_id!r} is not pinned")
        resident.refcount -= 1
        resident.last_use = self._tick()

    def drop_adapter(self, adapter_id: Hashable) -> bool:
        """Free an idle adapter's pages now and uncache the KV blocks tagged with it (unload).
        False if it is pinned or not resident (its blocks are uncached either way)."""
        for page in [p for p, tag in self._tag_of.items() if adapter_id in tag]:
            self._uncache(page)
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
        """Pages referenced by block tables (shared ones included)."""
        return set(self._kv)

    def kv_refcounts(self) -> dict[int, int]:
        """KV page -> the block tables that list it."""
        return dict(self._kv)

    def cached_pages(self) -> list[int]:
        """Idle cached KV blocks, least recently used first."""
        return list(self._idle)

    def block_hashes(self) -> dict[int, bytes]:
        """Cached page -> its block hash (idle and referenced ones)."""
        return dict(self._hash_of)

    def hashed_page(self, block_hash: bytes) -> int | None:
        return self._page_of.get(block_hash)

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
            cached_pages=len(self._idle),
            adapter_pages_pinned=pinned,
            adapter_pages_idle=self._evictable() - len(self._idle),
            resident_adapters=len(self._adapters),
            adapter_loads=self._loads,
            adapter_evictions=self._evictions,
            adapter_hits=self._hits,
            adapter_misses=self._misses,
        )
