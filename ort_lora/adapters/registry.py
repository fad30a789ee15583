"""AdapterRegistry: registered adapters, their users and unloading, a bounded host cache, and
the per-step LoRA inputs.

Pure bookkeeping over numpy: no onnxruntime, no torch. Which adapter sits in which pool pages
is the pool / scheduler's business; the registry turns (slot, adapter, pages) into the
lora_{m}_* graph inputs and copies an adapter's rows into pages on request.

DoRA adapters get their scale rows when loaded (adapters/dora.py), from the base weights of
the export the manifest was loaded from (adapters/base_weights.py) or those given. A
registered DoRA adapter's rows (one float per output row per module and layer) are kept, so a
reload after a host-cache eviction reads the files again but does not recompute them (unless
the adapter's files changed since). Composed
requests: `composition` checks a request's [(adapter, weight)], and lora_step_inputs takes the
step's segments as (slot, weight) terms (adapters/compose.py).

Unloading drains: `unload(name)` stops new users at once (`resolve` refuses the name, it is no
longer listed), but the adapter stays registered until its last user (an unfinished sequence,
counted with add_user / remove_user) is gone; the call that ends the drain returns the id, and
the caller frees the adapter's pool pages.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ort_lora.adapters.base_model import base_model_mismatch
from ort_lora.adapters.base_weights import BaseWeights, ExportedWeights
from ort_lora.adapters.bounds import storage_type
from ort_lora.adapters.compose import check_weights, segment_inputs
from ort_lora.adapters.digest import adapter_digest
from ort_lora.adapters.dora import dora_scale_rows
from ort_lora.adapters.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterPathError,
    CompositionError,
)
from ort_lora.adapters.host import WEIGHTS_NAME, HostAdapter, load_adapter
from ort_lora.adapters.layout import SlotLayout, prepare_rows, step_tables, write_to_pool
from ort_lora.adapters.peft_config import CONFIG_NAME
from ort_lora.contract import ModelManifest
from ort_lora.lora_request import LoRARequest

# (slot, adapter int id or name, pages) for each adapter slot of a step
StepSlots = list[tuple[int, int | str, tuple[int, ...]]]
# per segment of a step (lora_seg_starts order): its (slot, weight) terms; [] = base rows
StepSegments = list[list[tuple[int, float]]]
_MAX_STEP_ENTRIES = 1024
# Adapter names: what an API `model` field, a metrics label and a log line carry safely. No
# spaces, quotes, newlines or "+" (reserved to compose adapters), at most 128 characters.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")

logger = logging.getLogger("ort_lora.adapters")


def resolve_adapter_dir(path: str | Path, root: Path | None) -> Path:
    """The adapter directory, resolved (symlinks followed; a relative path is taken from
    `root` when given). With `root`, the directory and each file read from it must lie
    inside it (AdapterPathError); a path that cannot be resolved (a symlink loop, a NUL, a
    name too long) is an AdapterError. Errors show the path as given (cut to 200 characters)
    and the file's name in it, never where it resolves to nor the root (the server's layout)."""
    shown = repr(str(path)[:200])
    try:
        where = Path(path).expanduser()
        if root is not None and not where.is_absolute():
            where = Path(root) / where
        resolved = where.resolve()
        files = {name: (resolved / name).resolve() for name in (CONFIG_NAME, WEIGHTS_NAME)}
    except (OSError, RuntimeError, ValueError) as e:
        why = _unresolvable(e)
        raise AdapterError(f"adapter path {shown} cannot be resolved: {why}") from None
    if root is not None:
        root = Path(root).resolve()
        for name, p in [("", resolved), *files.items()]:
            if not p.is_relative_to(root):
                what = f"adapter path {shown}" + (f" (its {name})" if name else "")
                raise AdapterPathError(
                    f"{what} resolves outside the adapter root (symlinks are followed)"
                )
    return resolved


def _unresolvable(e: Exception) -> str:
    """Why a path cannot be resolved, without the paths an OSError or RuntimeError names."""
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    if isinstance(e, RuntimeError):
        return "a symlink loop"
    return "it holds a NUL character" if "null" in str(e) else "not a valid path"


def check_name(name: str) -> None:
    """AdapterError unless `name` is a valid adapter name (NAME_RE)."""
    if not NAME_RE.fullmatch(name):
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise AdapterError(
            f"adapter name {shown!r} is not allowed: 1-128 characters, letters, digits and "
            "._:@/- only, starting with a letter or digit"
        )


class AdapterRegistry:
    """Adapters by name and int id; converted adapters cached on the host, LRU-bounded.

    register() validates eagerly (a bad adapter fails there, with an AdapterError). Adapters
    evicted from the host cache are reloaded from disk by get(). With adapter_root set, every
    adapter path must resolve (symlinks followed) inside it, else AdapterPathError.
    base_weights: where DoRA adapters' base weights come from; None: the export the manifest
    was loaded from (manifest.model_dir), read back by memory map on the first DoRA adapter.
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
        self.max_cpu_loras = max_cpu_loras
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.base_weights = base_weights
        if base_weights is None and manifest.model_dir is not None:
            self.base_weights = ExportedWeights(manifest.model_dir)  # indexed on first use
        self._dora_ids: set[int] = set()  # registered DoRA adapters
        self._dora_rows_kept: dict[int, tuple[tuple, dict[str, np.ndarray]]] = {}  # id -> stamp, D
        self._requests: dict[int, LoRARequest] = {}
        self._ids: dict[str, int] = {}
        self._layouts: dict[int, SlotLayout] = {}  # of every registered adapter (no weights)
        self._digests: dict[int, tuple[tuple, bytes]] = {}  # id -> files' stamp, content digest
        self._host: OrderedDict[int, HostAdapter] = OrderedDict()
        self._step_parts: OrderedDict[tuple, dict] = OrderedDict()
        self._last_step: tuple[tuple, dict[str, np.ndarray]] | None = None
        self._users: dict[int, int] = {}  # int id -> unfinished sequences using it
        self.request_counts: dict[int, int] = {}  # int id -> requests served with it (metrics)
        self._unloading: set[int] = set()  # int ids drained before they are unregistered
        self.stats = {"loads": 0, "host_hits": 0, "host_misses": 0, "host_evictions": 0}

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
        self._requests[request.lora_int_id] = request
        self._ids[request.lora_name] = request.lora_int_id
        self._layouts[request.lora_int_id] = SlotLayout.of(adapter, self.manifest)
        self._digests[request.lora_int_id] = (self._stamp(request), adapter_digest(adapter))
        if adapter.is_dora:
            self._dora_ids.add(request.lora_int_id)
            rows = {m: w.dora for m, w in adapter.modules.items() if w.dora is not None}
            self._dora_rows_kept[request.lora_int_id] = (self._stamp(request), rows)
        self._cache(request.lora_int_id, adapter)
        return adapter

    def resolve(self, request: LoRARequest, register: bool = True) -> LoRARequest:
        """The registered request of this name (registered now if `register`, else not
        found); an adapter being unloaded is not found."""
        if self._is_unloading(request.lora_name) or self._is_unloading(request.lora_int_id):
            raise AdapterNotFoundError(f"adapter not found: {request.lora_name!r} (being unloaded)")
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
        if self._is_unloading(name_or_id):
            raise AdapterNotFoundError(f"adapter not found: {name_or_id!r} (being unloaded)")
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

    def unregister(self, name_or_id: str | int) -> LoRARequest:
        """Forget the adapter now (host copy and cached step inputs included)."""
        request = self.request(name_or_id)
        aid = request.lora_int_id
        assert not self._users.get(aid), f"adapter {request.lora_name!r} still has users"
        del self._requests[aid], self._ids[request.lora_name], self._layouts[aid]
        del self._digests[aid]
        self.request_counts.pop(aid, None)
        self._dora_ids.discard(aid)
        self._dora_rows_kept.pop(aid, None)
        self._host.pop(aid, None)
        for key in [k for k in self._step_parts if k[0] == aid]:
            del self._step_parts[key]
        self._last_step = None
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

    # --- host cache ---------------------------------------------------------------------------

    def get(self, name_or_id: str | int) -> HostAdapter:
        """The converted adapter, from the host cache or reloaded from disk."""
        aid = self.request(name_or_id).lora_int_id
        if aid in self._host:
            self.stats["host_hits"] += 1
            self._host.move_to_end(aid)
            return self._host[aid]
        self.stats["host_misses"] += 1
        kept = self._dora_rows_kept.get(aid)
        request = self._requests[aid]
        rows = kept[1] if kept is not None and kept[0] == self._stamp(request) else None
        adapter = self.load(request, rows)
        if not SlotLayout.of(adapter, self.manifest).same_as(self._layouts[aid]):
            raise AdapterError(
                f"adapter {request.lora_name!r}: its files changed since it was registered "
                "(ranks, scales or targeted modules differ); unload and load it again"
            )
        stamp, digest = self._digests[aid]
        if self._stamp(request) != stamp and adapter_digest(adapter) != digest:
            raise AdapterError(
                f"adapter {request.lora_name!r}: its weights changed since it was registered; "
                "unload and load it again"
            )  # (its KV in the prefix cache was computed with the registered weights)
        self._cache(aid, adapter)
        return adapter

    def digest(self, name_or_id: str | int) -> bytes:
        """The registered adapter's content digest (adapters/digest.py): what names its KV
        in the prefix cache."""
        return self._digests[self.request(name_or_id).lora_int_id][1]

    def cached_ids(self) -> list[int]:
        """Int ids of the adapters in the host cache, least recently used first."""
        return list(self._host)

    def num_pages_needed(self, name_or_id: str | int) -> int:
        """Pool pages the adapter occupies (known from registration, no reload)."""
        return self._layouts[self.request(name_or_id).lora_int_id].num_pages

    def load(
        self, request: LoRARequest, dora_rows: dict[str, np.ndarray] | None = None
    ) -> HostAdapter:
        """Read, check and convert the adapter's files (AdapterError names the problem);
        changes nothing here, so any thread may call it. dora_rows: a DoRA adapter's D per
        module, computed before from these same files (else computed now)."""
        check_name(request.lora_name)
        path = self._check_path(request.lora_path)
        try:
            adapter = load_adapter(request.lora_name, path, self.manifest)
        except OSError as e:  # unreadable, a directory where a file should be, too long
            raise AdapterError(
                f"adapter {request.lora_name!r}: cannot read its files: {_unresolvable(e)}"
            ) from None
        if (
            adapter.is_dora
            and dora_rows is not None
            and set(dora_rows) == {m for m, w in adapter.modules.items() if w.magnitude is not None}
        ):
            for m, d in dora_rows.items():
                adapter.modules[m].dora, adapter.modules[m].magnitude = d, None
        elif adapter.is_dora:
            self._dora_rows(adapter)
        prepare_rows(adapter, self.manifest.adapter_dtype)
        self.stats["loads"] += 1
        return adapter

    def _stamp(self, request: LoRARequest) -> tuple:
        """(size, mtime) of the adapter's files: whether kept DoRA rows are still theirs."""
        try:
            path = self._check_path(request.lora_path)
            stats = [(path / name).stat() for name in (CONFIG_NAME, WEIGHTS_NAME)]
        except (OSError, AdapterError):
            return ()
        return tuple((st.st_size, st.st_mtime_ns) for st in stats)

    def _dora_rows(self, adapter: HostAdapter) -> None:
        """Compute a DoRA adapter's scale rows; AdapterError when this export cannot serve it."""
        if "dora" not in self.manifest.lora_features:
            raise AdapterError(
                f"adapter {adapter.name!r} is a DoRA adapter (use_dora), but the exported model "
                "predates DoRA support (its manifest's lora_features lacks 'dora'): re-export it"
            )
        if self.base_weights is None:
            raise AdapterError(
                f"adapter {adapter.name!r} is a DoRA adapter (use_dora): its scale needs the "
                "base weights, and this registry has none (no model directory, no base_weights)"
            )
        dora_scale_rows(
            adapter, self.base_weights, self.manifest.adapter_dtype, storage_type(self.manifest)
        )

    def is_dora(self, name_or_id: str | int) -> bool:
        """Whether the registered adapter is a DoRA adapter (it cannot be composed)."""
        return self.request(name_or_id).lora_int_id in self._dora_ids

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
        for name_or_id, _ in adapters:
            if self._is_unloading(name_or_id):
                raise AdapterNotFoundError(f"adapter not found: {name_or_id!r} (being unloaded)")
        out = [(self.request(a).lora_int_id, w) for a, w in adapters]
        check_weights(out, [str(a) for a, _ in adapters], max_loras)
        for (aid, _), (name_or_id, _) in zip(out, adapters):
            if aid in self._dora_ids:
                raise CompositionError(
                    f"adapter {name_or_id!r} is a DoRA adapter: DoRA adapters cannot be composed "
                    "(each rescales the whole module output by its own magnitude)"
                )
        out = [(aid, float(w)) for aid, w in out]
        return tuple(out)

    def _cache(self, aid: int, adapter: HostAdapter) -> None:
        self._host[aid] = adapter
        self._host.move_to_end(aid)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
            self.stats["host_evictions"] += 1

    def _check_path(self, path: str) -> Path:
        return resolve_adapter_dir(path, self.adapter_root)

    # --- pool pages -----------------------------------------------------------------------------

    def write_to_pool(
        self, name_or_id: str | int, pages, pool: np.ndarray, adapter: HostAdapter | None = None
    ) -> None:
        """Copy the adapter's rows of every layer into its pages of the pool array. adapter:
        its host form in hand (registration's), else from the host cache or disk."""
        adapter = adapter if adapter is not None else self.get(name_or_id)
        write_to_pool(adapter, pages, pool, self.manifest.adapter_dtype)

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
        key = (num_pages, tuple((int(s), a, tuple(int(p) for p in pg)) for s, a, pg in slots))
        if self._last_step is None or self._last_step[0] != key:
            slot_ids = [s for s, _, _ in key[1]]
            if len(set(slot_ids)) != len(slot_ids) or any(s < 0 for s in slot_ids):
                raise ValueError(f"step slots must be distinct and >= 0, got {slot_ids}")
            parts = {slot: self._slot_part(aid, pages, num_pages) for slot, aid, pages in key[1]}
            self._last_step = (key, step_tables(parts, self.manifest))
        out = self._last_step[1]  # with E = 0 composition entries if the export has them
        if segments is None:
            return out
        if "composition" not in self.manifest.lora_features:
            raise ValueError("this export has no composition inputs (manifest lora_features)")
        dora = {s for s, aid, _ in key[1] if self.request(aid).lora_int_id in self._dora_ids}
        return out | segment_inputs(segments, dora)

    def clear_step_cache(self) -> None:
        """Drop the cached per-(adapter, pages) step inputs (they are rebuilt on demand)."""
        self._step_parts.clear()
        self._last_step = None

    def _slot_part(self, name_or_id: str | int, pages: tuple, num_pages: int) -> dict:
        """module -> (a_off [R], b_off [R], ranks int32 [L], scales float32 [L], dora_off) for
        one slot (dora_off -1: no DoRA rows)."""
        aid = self.request(name_or_id).lora_int_id
        key = (aid, pages, num_pages)
        if key in self._step_parts:
            self._step_parts.move_to_end(key)
            return self._step_parts[key]
        part = self._layouts[aid].part(pages, num_pages)  # no host copy needed
        self._step_parts[key] = part
        while len(self._step_parts) > _MAX_STEP_ENTRIES:
            self._step_parts.popitem(last=False)
        return part
