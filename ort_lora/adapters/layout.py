"""Where an adapter's LoRA rows live inside its pool pages (the contract in ort_lora/contract.py).

In layer l the pool share is one flat array: key_cache.{l} then value_cache.{l}, so half h of
page p starts at flat element (h * num_pages + p) * page_elems. An adapter owns a list of
pages, the same in every layer, i.e. 2 * len(pages) "halves" of page_elems elements each.
Rows (max_rank_m rows of A, length in_m, and of B^T, length out_m, per module m, and a DoRA
adapter's row D, length out_m, per module) are packed first-fit-decreasing into those halves,
so no row straddles a half. The packing depends only on the adapter, page_elems and the row
type; the page list just maps half i to page pages[i // 2], half i % 2. The row type
(pool_row_type: manifest.adapter_dtype, or with "auto" the adapter's own) is None (rows in the
pool's dtype, one value per element) or, in a float32 pool, "bfloat16", "float16" or "int8"
(ort_lora/adapter_rows.py: a row of n values takes row_elems(n) elements). step_tables turns
the slots' offsets, ranks, scales and row types into a step's LoRA graph inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ort_lora.adapter_rows import AUTO, ROW_TYPES, encode_rows, exact_row_type, row_elems
from ort_lora.adapters.compose import composition_entries
from ort_lora.adapters.errors import AdapterError
from ort_lora.contract import LORA_MODULES, LORA_ROW_TYPES, lora_input_name

if TYPE_CHECKING:
    from ort_lora.adapters.host import HostAdapter
    from ort_lora.contract import ModelManifest


@dataclass(frozen=True)
class Packing:
    """Row placement relative to the adapter's halves: half index and offset inside the half."""

    num_halves: int
    # module -> (a_half [R], a_rel [R], b_half [R], b_rel [R]), all int64
    rows: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    # module -> (half, offset in it) of its DoRA row D; DoRA modules only
    dora: dict[str, tuple[int, int]]

    @property
    def num_pages(self) -> int:
        return (self.num_halves + 1) // 2


def pool_row_type(adapter: HostAdapter, manifest: ModelManifest) -> str | None:
    """The type of the adapter's rows in this export's pool: manifest.adapter_dtype or, with
    "auto", the adapter's own (adapter_rows.exact_row_type of its A, B^T and DoRA rows: float16
    or bfloat16 where that holds every value exactly, else None, float32 rows; cached on the
    adapter, whose DoRA rows must be computed first)."""
    if manifest.adapter_dtype != AUTO:
        return manifest.adapter_dtype
    cache = adapter._row_type
    if not cache:
        w = adapter.modules.values()
        cache[AUTO] = exact_row_type(r for m in w for r in (m.a, m.bt, m.dora) if r is not None)
    return cache[AUTO]


def packing(adapter: HostAdapter, page_elems: int, row_type: str | None = None) -> Packing:
    """First-fit-decreasing packing of every row of the adapter (cached on the adapter)."""
    cache = adapter._packings
    if (page_elems, row_type) not in cache:
        cache[page_elems, row_type] = _pack(adapter, page_elems, row_type)
    return cache[page_elems, row_type]


def _pack(adapter: HostAdapter, page_elems: int, row_type: str | None) -> Packing:
    items = []  # (length in pool elements, module, kind, row)
    for m, w in adapter.modules.items():
        assert w.magnitude is None, "DoRA rows are computed (adapters/dora.py) before the layout"
        kinds = [("a", w.a.shape[2], w.max_rank), ("b", w.bt.shape[2], w.max_rank)]
        kinds += [("d", w.bt.shape[2], 1)] if w.dora is not None else []
        for kind, n, count in kinds:
            length = row_elems(n, row_type)
            if length > page_elems:
                raise AdapterError(
                    f"adapter {adapter.name!r}: module {m} rows of length {length} do not fit a "
                    f"page half of {page_elems} elements; export with a larger block_size"
                )
            items += [(length, m, kind, j) for j in range(count)]
    items.sort(key=lambda it: -it[0])  # stable: module order kept among equal lengths
    free: list[int] = []  # remaining elements of each half
    place = {}
    for length, m, kind, j in items:
        h = next((i for i, f in enumerate(free) if f >= length), len(free))
        if h == len(free):
            free.append(page_elems)
        place[m, kind, j] = (h, page_elems - free[h])
        free[h] -= length
    rows = {}
    for m, w in adapter.modules.items():
        a = np.array([place[m, "a", j] for j in range(w.max_rank)], np.int64).reshape(-1, 2)
        b = np.array([place[m, "b", j] for j in range(w.max_rank)], np.int64).reshape(-1, 2)
        rows[m] = (a[:, 0], a[:, 1], b[:, 0], b[:, 1])
    dora = {m: place[m, "d", 0] for m in adapter.modules if (m, "d", 0) in place}
    return Packing(len(free), rows, dora)


@dataclass(frozen=True)
class SlotLayout:
    """What a step needs of a registered adapter besides its pages: where its rows sit in them
    (the packing) and each module's ranks and scales per layer. A few KB, no weights: the
    registry keeps one per registered adapter, so building a step's inputs never rereads an
    adapter the host cache has evicted."""

    name: str
    packing: Packing
    page_elems: int
    ranks_scales: dict[str, tuple[np.ndarray, np.ndarray]]  # module -> (int32 [L], float32 [L])
    row_type: str | None  # pool_row_type's

    @classmethod
    def of(cls, adapter: HostAdapter, manifest: ModelManifest) -> SlotLayout:
        pe, row_type = manifest.page_elems, pool_row_type(adapter, manifest)
        modules = {m: (w.ranks.copy(), w.scales.copy()) for m, w in adapter.modules.items()}
        return cls(adapter.name, packing(adapter, pe, row_type), pe, modules, row_type)

    @property
    def num_pages(self) -> int:
        return self.packing.num_pages

    def same_as(self, other: SlotLayout) -> bool:
        """Whether two loads of an adapter put the same rows in the same places (its files
        unchanged in what the step inputs depend on)."""
        pk, pk2 = self.packing, other.packing
        same_rows = pk.rows.keys() == pk2.rows.keys() and all(
            all(np.array_equal(x, y) for x, y in zip(pk.rows[m], pk2.rows[m])) for m in pk.rows
        )
        same_rs = self.ranks_scales.keys() == other.ranks_scales.keys() and all(
            all(np.array_equal(x, y) for x, y in zip(rs, other.ranks_scales[m]))
            for m, rs in self.ranks_scales.items()
        )
        same_pages = pk.num_halves == pk2.num_halves and pk.dora == pk2.dora
        return same_pages and same_rows and same_rs and self.row_type == other.row_type

    def part(self, pages, num_pages: int) -> dict[str, tuple]:
        """module -> (a_offsets int64 [max_rank_m], b_offsets int64 [max_rank_m], ranks int32
        [L], scales float32 [L], dora_offset) for these pages: flat element offsets into one
        layer's pool share (key_cache then value_cache) of a pool with num_pages pages;
        dora_offset -1 for a module without DoRA rows."""
        pk = self.packing
        half_start = _half_starts(self.name, pages, pk, num_pages, self.page_elems)
        out = {}
        for m, (ah, arel, bh, brel) in pk.rows.items():
            dh, drel = pk.dora.get(m, (-1, -1))
            dora = int(half_start[dh] + drel) if dh >= 0 else -1
            ranks, scales = self.ranks_scales[m]
            out[m] = (half_start[ah] + arel, half_start[bh] + brel, ranks, scales, dora)
        return out


def step_tables(
    parts: dict[int, dict], manifest: ModelManifest, row_types: dict[int, str | None] | None = None
) -> dict[str, np.ndarray]:
    """The per-module LoRA graph inputs of a step from each slot's part (slot -> module ->
    (a_offsets [R], b_offsets [R], ranks int32 [L], scales float32 [L], dora_offset)):
    lora_{m}_{a_offsets,b_offsets,ranks,scales} and, as the export has them,
    lora_{m}_dora_offsets, the empty (E = 0) lora_comp_* inputs and (adapter_dtype "auto")
    lora_row_types from each slot's row type (row_types; None or absent: float32). Slots without
    a part and modules a slot's adapter does not target get rank 0 (and dora_offset -1)."""
    num_slots = max(parts, default=0) + 1
    num_layers = manifest.num_layers
    out = {}
    for m in (m for m in LORA_MODULES if m in manifest.lora_targets):
        rank = max([len(p[m][0]) for p in parts.values() if m in p], default=1)
        a_off = np.zeros((num_slots, rank), np.int64)
        b_off = np.zeros((num_slots, rank), np.int64)
        ranks = np.zeros((num_layers, num_slots), np.int32)
        scales = np.zeros((num_layers, num_slots), np.float32)
        dora = np.full(num_slots, -1, np.int64)
        for slot, p in parts.items():
            if m in p:
                a, b, r, s, d = p[m]
                a_off[slot, : len(a)], b_off[slot, : len(b)] = a, b
                ranks[:, slot], scales[:, slot], dora[slot] = r, s, d
        out[lora_input_name(m, "a_offsets")] = a_off
        out[lora_input_name(m, "b_offsets")] = b_off
        out[lora_input_name(m, "ranks")] = ranks
        out[lora_input_name(m, "scales")] = scales
        if "dora" in manifest.lora_features:
            out[lora_input_name(m, "dora_offsets")] = dora
    if "composition" in manifest.lora_features:
        out |= composition_entries()
    if manifest.adapter_dtype == AUTO:
        types = row_types or {}
        codes = [ROW_TYPES[types.get(s) or "float32"] for s in range(num_slots)]
        out[LORA_ROW_TYPES] = np.array(codes, np.int32)
    return out


def _half_starts(name: str, pages, pk: Packing, num_pages: int, page_elems: int) -> np.ndarray:
    pages = np.asarray(pages, dtype=np.int64).reshape(-1)
    if len(pages) < pk.num_pages:
        raise AdapterError(f"adapter {name!r} needs {pk.num_pages} pages, got {len(pages)}")
    if len(np.unique(pages)) != len(pages) or pages.min() < 0 or pages.max() >= num_pages:
        raise AdapterError(
            f"adapter {name!r}: pages {pages.tolist()} must be distinct and in [0, {num_pages})"
        )
    half = np.arange(pk.num_halves)
    return (half % 2 * num_pages + pages[half // 2]) * page_elems  # [num_halves]


def write_to_pool(
    adapter: HostAdapter, pages, pool: np.ndarray, row_type: str | None = None
) -> None:
    """Copy every row of every layer of the adapter into its pages of the pool.

    pool: C-contiguous [num_layers, 2, num_pages, block_size, kv_heads, head_dim], any float
    dtype (rows are cast); row_type "bfloat16" or "int8": a float32 pool holding rows of that
    type (adapter_rows.py). One strided copy per row covers all layers at once.
    """
    if row_type is not None and pool.dtype != np.float32:
        raise AdapterError(f"{row_type} rows go into a float32 pool, got a {pool.dtype} pool")
    if pool.ndim != 6 or not pool.flags.c_contiguous:
        raise AdapterError(
            f"pool must be a C-contiguous [num_layers, 2, num_pages, block, kv_heads, head_dim] "
            f"array, got shape {pool.shape} (contiguous={pool.flags.c_contiguous})"
        )
    num_layers, _, num_pages = pool.shape[:3]
    page_elems = int(np.prod(pool.shape[3:]))
    flat = pool.reshape(num_layers, -1)  # [L, 2 * num_pages * page_elems], a view
    pk = packing(adapter, page_elems, row_type)
    half_start = _half_starts(adapter.name, pages, pk, num_pages, page_elems)
    if row_type is not None:
        flat = flat.view(np.uint32)  # bit patterns, copied as they are
    for m, w in adapter.modules.items():
        if w.a.shape[0] != num_layers:
            raise AdapterError(
                f"adapter {adapter.name!r} has {w.a.shape[0]} layers; the pool has {num_layers}"
            )
        ah, arel, bh, brel = pk.rows[m]
        a, bt, d = _encoded_rows(adapter, m, row_type) if row_type else (w.a, w.bt, w.dora)
        _copy_rows(flat, a, half_start[ah] + arel)
        _copy_rows(flat, bt, half_start[bh] + brel)
        if d is not None:
            dh, drel = pk.dora[m]
            _copy_rows(flat, d[:, None], half_start[[dh]] + drel)


def prepare_rows(adapter: HostAdapter, row_type: str | None) -> None:
    """Convert the rows for pool loads now (when the adapter is loaded into host memory), not
    on its first pool load inside a step."""
    if row_type is not None:
        for module in adapter.modules:
            _encoded_rows(adapter, module, row_type)


def _encoded_rows(adapter: HostAdapter, module: str, row_type: str) -> tuple:
    """The module's A, B^T and DoRA rows (None without DoRA) as pool elements of row_type
    (uint32 [L, R, row_elems]), converted once per host adapter (every later pool load is then
    a plain copy of a half or a quarter of the float32 bytes)."""
    cache = adapter._pool_rows
    if module not in cache:
        w = adapter.modules[module]
        d = None if w.dora is None else encode_rows(w.dora[:, None], row_type)[:, 0]
        cache[module] = (encode_rows(w.a, row_type), encode_rows(w.bt, row_type), d)
    return cache[module]


def _copy_rows(flat: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> None:
    """flat [L, E] <- rows [L, R, n] at starts [R]; rows placed back to back copy as one block."""
    n = rows.shape[2]
    breaks = np.flatnonzero(np.diff(starts) != n) + 1
    for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(starts)]):
        s = int(starts[lo])
        flat[:, s : s + (hi - lo) * n] = rows[:, lo:hi].reshape(len(rows), -1)
