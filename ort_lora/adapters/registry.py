"""AdapterRegistry: which adapters are registered, under which names and int ids, who uses
them, and their unloading; the one object the engine asks about adapters.

Its parts, one job each:
  names.py        what an adapter may be called and where its files may live
  loader.py       AdapterLoader: read, check and convert an adapter's files (and DoRA rows)
  host_cache.py   HostCache: converted adapters kept in host memory, LRU-bounded
  step_inputs.py  StepInputs: the per-step LoRA graph inputs of (slot, adapter, pages)
  digest.py       the content digest that names an adapter's KV in the prefix cache
The registry keeps, per registered adapter: its request, its layout (pool pages, no weights),
its content digest, whether it is DoRA and its DoRA rows (so that a reload after a host-cache
eviction reads the files again but does not recompute them, unless they changed since).
Which adapter sits in which pool pages is the pool / scheduler's business. Composed requests:
`composition` checks a request's [(adapter, weight)] (adapters/compose.py).

Unloading drains: `unload(name)` stops new users at once (`resolve` refuses the name, it is no
longer listed), but the adapter stays registered until its last user (an unfinished sequence,
counted with add_user / remove_user) is gone; the call that ends the drain returns the id, and
the caller frees the adapter's pool pages.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ort_lora.adapters.base_model import base_model_mismatch
from ort_lora.adapters.base_weights import BaseWeights
from ort_lora.adapters.compose import check_weights
from ort_lora.adapters.digest import adapter_digest
from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError, CompositionError
from ort_lora.adapters.host import HostAdapter
from ort_lora.adapters.host_cache import HostCache
from ort_lora.adapters.layout import SlotLayout, pool_row_type, write_to_pool
from ort_lora.adapters.loader import AdapterLoader
from ort_lora.adapters.names import NAME_RE, check_name, resolve_adapter_dir
from ort_lora.adapters.step_inputs import StepInputs, StepSegments
from ort_lora.contract import ModelManifest
from ort_lora.lora_request import LoRARequest

__all__ = ["NAME_RE", "AdapterRegistry", "check_name", "resolve_adapter_dir"]

# (slot, adapter int id or name, pages) for each adapter slot of a step
StepSlots = list[tuple[int, int | str, tuple[int, ...]]]

logger = logging.getLogger("ort_lora.adapters")


class AdapterRegistry:
    """Adapters by name and int id; converted adapters cached on the host, LRU-bounded.

    register() validates eagerly (a bad adapter fails there, with an AdapterError). Adapters
    evicted from the host cache are reloaded from disk by get(). With adapter_root set, every
    adapter path must resolve (symlinks followed) inside it, else AdapterPathError.
    base_weights: where DoRA adapters' base weights come from (AdapterLoader).
    """

    def __init__(
        self,
        manifest: ModelManifest,
        max_cpu_loras: int = 8,
        adapter_root: str | Path | None = None,
        base_weights: BaseWeights | None = None,
    ):
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int):
            raise ValueError(f"max_cpu_loras must be an integer >= 0, got {max_cpu_loras!r}")
        if max_cpu_loras < 0:
            raise ValueError(f"max_cpu_loras must be >= 0, got {max_cpu_loras}")
        self.manifest = manifest
        self.loader = AdapterLoader(manifest, adapter_root, base_weights)
        self._host = HostCache(max_cpu_loras, self._reload)
        self._step = StepInputs(manifest)
        self._requests: dict[int, LoRARequest] = {}
        self._ids: dict[str, int] = {}
        self._layouts: dict[int, SlotLayout] = {}  # of every registered adapter (no weights)
        self._digests: dict[int, tuple[tuple, bytes]] = {}  # id -> files' stamp, content digest
        self._dora_rows_kept: dict[int, tuple[tuple, dict[str, np.ndarray]]] = {}  # id -> stamp, D
        self._users: dict[int, int] = {}  # int id -> unfinished sequences using it
        self.request_counts: dict[int, int] = {}  # int id -> requests served with it (metrics)
        self._unloading: set[int] = set()  # int ids drained before they are unregistered

    @property
    def base_weights(self) -> BaseWeights | None:
        """Where DoRA adapters' base weights come from (the loader's)."""
        return self.loader.base_weights

    @base_weights.setter
    def base_weights(self, weights: BaseWeights | None) -> None:
        self.loader.base_weights = weights

    @property
    def stats(self) -> dict[str, int]:
        """Adapter reads ("loads") and host-cache hits, misses and evictions."""
        return {"loads": self.loader.loads, **self._host.stats}

    # --- registration -------------------------------------------------------------------------

    def register(self, request: LoRARequest, adapter: HostAdapter | None = None) -> HostAdapter:
        """Validate, convert and cache the adapter; idempotent for an identical request.
        adapter: the result of load(request), read beforehand (off the engine's thread)."""
        if self._is_unloading(request.lora_name) or self._is_unloading(request.lora_int_id):
            raise AdapterError(f"adapter {request.lora_name!r} is being unloaded; retry")
        old = self._requests.get(request.lora_int_id)
        if old == request:
            return self.get(request.lora_int_id)
        if old is not None:
            raise AdapterError(
                f"lora_int_id {request.lora_int_id} is already registered as {old.lora_name!r}; "
                "unregister it first"
            )
        if request.lora_name in self._ids:
            raise AdapterError(
                f"adapter name {request.lora_name!r} is already registered with lora_int_id "
                f"{self._ids[request.lora_name]}"
            )
        adapter = adapter if adapter is not None else self.load(request)
        other_base = base_model_mismatch(adapter.base_model, self.manifest.source)
        if other_base is not None:
            logger.warning("adapter %r: %s", request.lora_name, other_base)
        aid, stamp = request.lora_int_id, self.loader.stamp(request)
        self._requests[aid] = request
        self._ids[request.lora_name] = aid
        self._layouts[aid] = SlotLayout.of(adapter, self.manifest)
        self._digests[aid] = (stamp, adapter_digest(adapter))
        if adapter.is_dora:
            rows = {m: w.dora for m, w in adapter.modules.items() if w.dora is not None}
            self._dora_rows_kept[aid] = (stamp, rows)
        self._host.put(aid, adapter)
        return adapter

    def resolve(self, request: LoRARequest, register: bool = True) -> LoRARequest:
        """The registered request of this name (registered now if `register`, else not
        found); an adapter being unloaded is not found."""
        self._not_unloading(request.lora_name, request.lora_int_id, shown=request.lora_name)
        if request.lora_name in self._ids:
            return self.request(request.lora_name)
        if not register:
            raise AdapterNotFoundError(f"adapter not found: {request.lora_name!r}")
        self.register(request)
        return request

    def add_user(self, aid: int) -> None:
        """One more unfinished sequence uses the adapter (resolve it first)."""
        self._users[aid] = self._users.get(aid, 0) + 1

    def remove_user(self, aid: int) -> int | None:
        """A sequence using the adapter finished; returns aid if that ended its unloading
        (it is unregistered now: free its pool pages)."""
        self._users[aid] -= 1
        if self._users[aid] == 0:
            del self._users[aid]
        return self._finish_unload(aid)

    def count_request(self, aid: int) -> None:
        """One more request runs with the adapter, alone or composed (per-adapter metrics)."""
        self.request_counts[aid] = self.request_counts.get(aid, 0) + 1

    def user_counts(self) -> dict[int, int]:
        """int id -> unfinished sequences using it (adapters with users only)."""
        return dict(self._users)

    def unload(self, name_or_id: str | int) -> int | None:
        """Stop new users of the adapter and unregister it once the last user is gone.
        Returns its id if that is now (free its pool pages), else None (draining)."""
        self._not_unloading(name_or_id)
        aid = self.request(name_or_id).lora_int_id
        self._unloading.add(aid)
        return self._finish_unload(aid)

    def _finish_unload(self, aid: int) -> int | None:
        if aid not in self._unloading or self._users.get(aid):
            return None
        self._unloading.discard(aid)
        self.unregister(aid)
        return aid

    def _is_unloading(self, name_or_id: str | int) -> bool:
        aid = self._ids.get(name_or_id) if isinstance(name_or_id, str) else name_or_id
        return aid in self._unloading

    def _not_unloading(self, *names_or_ids: str | int, shown: str | None = None) -> None:
        """AdapterNotFoundError naming the first of these names or ids that is an adapter
        being unloaded (or `shown`): the one guard of resolving, unloading and composing."""
        for name_or_id in names_or_ids:
            if self._is_unloading(name_or_id):
                name = shown if shown is not None else name_or_id
                raise AdapterNotFoundError(f"adapter not found: {name!r} (being unloaded)")

    def unregister(self, name_or_id: str | int) -> LoRARequest:
        """Forget the adapter now (host copy and cached step inputs included)."""
        request = self.request(name_or_id)
        aid = request.lora_int_id
        assert not self._users.get(aid), f"adapter {request.lora_name!r} still has users"
        del self._requests[aid], self._ids[request.lora_name], self._layouts[aid]
        del self._digests[aid]
        self.request_counts.pop(aid, None)
        self._dora_rows_kept.pop(aid, None)
        self._host.drop(aid)
        self._step.forget(aid)
        return request

    def request(self, name_or_id: str | int) -> LoRARequest:
        """The LoRARequest registered under this name or int id; AdapterNotFoundError if none."""
        aid = self._ids.get(name_or_id) if isinstance(name_or_id, str) else name_or_id
        if aid not in self._requests:
            known = sorted(self._ids)
            raise AdapterNotFoundError(f"adapter not found: {name_or_id!r} (registered: {known})")
        return self._requests[aid]

    def __contains__(self, name_or_id: str | int) -> bool:
        if isinstance(name_or_id, str):
            return name_or_id in self._ids
        return name_or_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def requests(self) -> list[LoRARequest]:
        """The adapters served: registered and not being unloaded."""
        return [r for aid, r in self._requests.items() if aid not in self._unloading]

    # --- what is known of a registered adapter --------------------------------------------------

    def num_pages_needed(self, name_or_id: str | int) -> int:
        """Pool pages the adapter occupies (known from registration, no reload)."""
        return self._layouts[self.request(name_or_id).lora_int_id].num_pages

    def row_type(self, name_or_id: str | int) -> str | None:
        """The type of the registered adapter's rows in the pool (layout.pool_row_type; None:
        the pool's dtype)."""
        return self._layouts[self.request(name_or_id).lora_int_id].row_type

    def digest(self, name_or_id: str | int) -> bytes:
        """The registered adapter's content digest (adapters/digest.py): what names its KV
        in the prefix cache."""
        return self._digests[self.request(name_or_id).lora_int_id][1]

    def is_dora(self, name_or_id: str | int) -> bool:
        """Whether the registered adapter is a DoRA adapter (it cannot be composed)."""
        return self.request(name_or_id).lora_int_id in self._dora_rows_kept

    def composition(
        self, adapters: list[tuple[str | int, float]], max_loras: int | None = None
    ) -> tuple[tuple[int, float], ...]:
        """A composed request's adapters [(name or int id, weight)] checked and resolved to
        ((int id, weight), ...), in order. CompositionError naming the problem: no adapter, more
        than max_loras, one twice, a weight not finite, an adapter not registered (or being
        unloaded: AdapterNotFoundError), a DoRA adapter (cannot be composed), an export without
        composition. A weight must be a number (not a bool nor a string) with |weight| <=
        lora_request.MAX_WEIGHT: LoraSGMV multiplies it, in float32, into the adapter's scale.
        The adapters must be registered first (resolve / register)."""
        if "composition" not in self.manifest.lora_features:
            raise CompositionError(
                "the exported model predates composition (its manifest's lora_features lacks "
                "'composition'): re-export it to compose adapters"
            )
        self._not_unloading(*(name_or_id for name_or_id, _ in adapters))
        out = [(self.request(a).lora_int_id, w) for a, w in adapters]
        check_weights(out, [str(a) for a, _ in adapters], max_loras)
        for (aid, _), (name_or_id, _) in zip(out, adapters):
            if self.is_dora(aid):
                raise CompositionError(
                    f"adapter {name_or_id!r} is a DoRA adapter: DoRA adapters cannot be composed "
                    "(each rescales the whole module output by its own magnitude)"
                )
        return tuple((aid, float(w)) for aid, w in out)

    # --- host copies ----------------------------------------------------------------------------

    def get(self, name_or_id: str | int) -> HostAdapter:
        """The converted adapter, from the host cache or reloaded from disk."""
        return self._host.get(self.request(name_or_id).lora_int_id)

    def cached_ids(self) -> list[int]:
        """Int ids of the adapters in the host cache, least recently used first."""
        return self._host.ids()

    def load(
        self, request: LoRARequest, dora_rows: dict[str, np.ndarray] | None = None
    ) -> HostAdapter:
        """Read, check and convert the adapter's files (AdapterLoader.load); changes nothing
        here, so any thread may call it."""
        return self.loader.load(request, dora_rows)

    def _reload(self, aid: int) -> HostAdapter:
        """A registered adapter read from disk again (a host-cache miss): its kept DoRA rows
        reused if its files did not change; AdapterError if they hold another adapter now."""
        request, kept = self._requests[aid], self._dora_rows_kept.get(aid)
        stamp = self.loader.stamp(request)
        adapter = self.load(request, kept[1] if kept is not None and kept[0] == stamp else None)
        if not SlotLayout.of(adapter, self.manifest).same_as(self._layouts[aid]):
            raise AdapterError(
                f"adapter {request.lora_name!r}: its files changed since it was registered "
                "(ranks, scales or targeted modules differ); unload and load it again"
            )
        registered_stamp, digest = self._digests[aid]
        if stamp != registered_stamp and adapter_digest(adapter) != digest:
            raise AdapterError(
                f"adapter {request.lora_name!r}: its weights changed since it was registered; "
                "unload and load it again"
            )  # (its KV in the prefix cache was computed with the registered weights)
        return adapter

    # --- pool pages and step inputs -------------------------------------------------------------

    def write_to_pool(
        self, name_or_id: str | int, pages, pool: np.ndarray, adapter: HostAdapter | None = None
    ) -> None:
        """Copy the adapter's rows of every layer into its pages of the pool array. adapter:
        its host form in hand (registration's), else from the host cache or disk."""
        adapter = adapter if adapter is not None else self.get(name_or_id)
        write_to_pool(adapter, pages, pool, pool_row_type(adapter, self.manifest))

    def lora_step_inputs(
        self, slots: StepSlots, num_pages: int, segments: StepSegments | None = None
    ) -> dict[str, np.ndarray]:
        """The LoRA graph inputs of one step beyond lora_seg_starts: per module
        lora_{m}_{a_offsets,b_offsets,ranks,scales} and, when the export has them,
        lora_{m}_dora_offsets and lora_comp_{segs,slots,weights}.

        slots: (slot, adapter int id or name, pages) per adapter slot; slots not listed (and
        modules an adapter does not target) get rank 0; no slots -> one dummy slot of rank 0.
        num_pages: pages in the pool (offsets of value halves depend on it).
        segments: None -> no composition (E = 0; lora_seg_slots stays the caller's). Else every
        segment's (slot, weight) terms in lora_seg_starts order; the result then holds
        lora_seg_slots too (compose.segment_inputs), replacing the caller's. A composed segment
        holding a DoRA adapter's slot is a ValueError (composition() refuses such requests).
        The per-module arrays are cached per (adapter, pages) and shared with the cache: do not
        modify them.
        """
        ids = [(s, self.request(a).lora_int_id, pages) for s, a, pages in slots]
        return self._step.inputs(ids, num_pages, segments, self._layouts, self._dora_rows_kept)

    def clear_step_cache(self) -> None:
        """Drop the cached per-(adapter, pages) step inputs (they are rebuilt on demand)."""
        self._step.clear()
