"""Numpy reference of the LoraSGMV operator, and a helper that places random adapters in a pool.

`lora_sgmv` is the readable definition of the op (custom_ops/lora_sgmv/lora_sgmv_op.h) and the
oracle its tests compare the kernel with; `lora_sgmv_modules` that of a node serving several
modules that read one x (attribute modules). `place_random_adapters` lays adapters' A and B^T rows
out in one layer's pool share the way the engine does (offsets into key_cache ++ value_cache),
for tests and benchmarks. Rows are float32 pool elements, or (adapter_dtype="bfloat16",
"float16" or "int8") rows of those types in the float32 pool, laid out as
ort_lora/adapter_rows.py says; a type per slot (row_types, slot_dtypes) mixes them in one pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ort_lora.adapter_rows import HALF_TYPES, ROW_TYPES, decode_rows, encode_rows, row_elems

ADAPTER_DTYPES = ROW_TYPES  # name -> LoraSGMV attribute adapter_dtype
BF16_NAN_PAIR = 0x7FC07FC0  # a float32 NaN whose two 16-bit halves are NaN as bfloat16 and float16


def _check_adapter_dtype(adapter_dtype: str) -> None:
    if adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(
            f"adapter_dtype must be one of {list(ADAPTER_DTYPES)}, got {adapter_dtype!r}"
        )


def _slot_types(
    row_types: list[str] | None, adapter_dtype: str, num_slots: int, what: str
) -> list[str]:
    """The row type of each slot: row_types[slot], or adapter_dtype for all when row_types is
    None or empty (the op's row_types of shape [0])."""
    _check_adapter_dtype(adapter_dtype)
    if row_types is None or len(row_types) == 0:
        return [adapter_dtype] * num_slots
    if len(row_types) != num_slots:
        raise ValueError(f"{what} must name one row type per slot ({num_slots}), got {row_types}")
    for slot, row_type in enumerate(row_types):
        if row_type not in ADAPTER_DTYPES:
            raise ValueError(
                f"{what}[{slot}] must be one of {list(ADAPTER_DTYPES)}, got {row_type!r}"
            )
    return list(row_types)


def _pool_row(
    region: np.ndarray, num_key: int, offset: int, features: int, what: str, adapter_dtype: str
) -> np.ndarray:
    """float64 [features]: the row at pool element `offset` of the flat float32 pool share; the
    pool elements it spans must not cross K/V or the end."""
    length = row_elems(features, adapter_dtype)
    end = offset + length
    inside_key = offset >= 0 and end <= num_key
    inside_value = num_key <= offset and end <= region.size
    if not (inside_key or inside_value):
        raise ValueError(
            f"{what} = {offset}: a row of {length} elements must lie inside key_cache "
            f"[0, {num_key}) or value_cache [{num_key}, {region.size}) (out-of-range page)"
        )
    if adapter_dtype == "float32":
        return region[offset:end].astype(np.float64)
    return decode_rows(region[offset:end], features, adapter_dtype).astype(np.float64)


def lora_sgmv(
    y: np.ndarray,  # float [T, out]
    x: np.ndarray,  # float [T, in]
    key_cache: np.ndarray,  # float [num_pages, block_size, kv_heads, head_dim]
    value_cache: np.ndarray,  # float [num_pages, block_size, kv_heads, head_dim]
    seg_starts: np.ndarray,  # int32 [S + 1]
    seg_slots: np.ndarray,  # int32 [S]
    a_offsets: np.ndarray,  # int64 [num_slots, max_rank]
    b_offsets: np.ndarray,  # int64 [num_slots, max_rank]
    ranks: np.ndarray,  # int32 [num_layers, num_slots]
    scales: np.ndarray,  # float [num_layers, num_slots]
    layer: int,
    adapter_dtype: str = "float32",
    *,
    comp_segs: np.ndarray | None = None,  # int32 [E]
    comp_slots: np.ndarray | None = None,  # int32 [E]
    comp_weights: np.ndarray | None = None,  # float [E]
    dora_offsets: np.ndarray | None = None,  # int64 [num_slots] or [0]
    row_types: list[str] | None = None,  # [num_slots] row type names, or None / []
) -> np.ndarray:
    """y_out float32 [T, out]: y plus every segment's weighted LoRA deltas, then the DoRA scale
    of a DoRA segment's rows; computed in float64.

    Semantics:
      region = key_cache.ravel() ++ value_cache.ravel()   (this layer's pool share, flat)
      terms(s) = [(seg_slots[s], 1.0)] if seg_slots[s] >= 0, then
                 [(comp_slots[e], comp_weights[e]) for e with comp_segs[e] == s]  (in order e)
      for each segment s, rows t in [seg_starts[s], seg_starts[s + 1]):
        delta[t] = sum over (slot, w) in terms(s) with r = ranks[layer, slot] > 0:
          A  = [region[a_offsets[slot, j] : + in ] for j < r]      # [r, in]   rows of A
          Bt = [region[b_offsets[slot, j] : + out] for j < r]      # [r, out]  rows of B^T
          w * scales[layer, slot] * (x[t] @ A^T) @ Bt
        no term with r > 0:        y_out[t] = y[t]
        DoRA: terms(s) is ONE (slot, w) with dora_offsets[slot] >= 0:
          D = region[dora_offsets[slot] : + out]                 # [out]  m / ||W + sBA|| - 1
          y_out[t] = (y[t] + delta[t]) * (1 + D)
        else:                      y_out[t] = y[t] + delta[t]
      A DoRA slot among two or more terms of a segment is an error (DoRA's magnitude belongs to
      one adapter; a composition of DoRA adapters has no definition to follow). dora_offsets
      of shape [0], or None, means no slot is DoRA; comp_* None means E = 0.
      y is the base projection W x WITHOUT its bias (the graph adds a bias after the op), so
      with DoRA y_out + bias is PEFT's m / ||W + s B A||_row * (W x + s B A x) + bias.
      A row lies entirely inside key_cache or entirely inside value_cache.
      Offsets of rows j >= r, and dora_offsets of slots no DoRA segment uses, are never read.
    adapter_dtype="bfloat16" (attribute adapter_dtype = 16): a row (A, B^T or D) at pool
      element o holds bfloat16 values: region viewed as uint16 (little-endian), elements
      [2 o, 2 o + len), widened exactly (bits << 16); it spans ceil(len / 2) pool elements,
      which must lie inside key_cache or value_cache.
    adapter_dtype="float16" (attribute adapter_dtype = 10): as bfloat16, the 16-bit values
      IEEE float16 (widened exactly).
    adapter_dtype="int8" (attribute adapter_dtype = 3): element o is the row's float32 scale,
      then int8 values q from byte 4 (o + 1), value = scale * q; it spans 1 + ceil(len / 4)
      pool elements.
    row_types (the op's input row_types, names for its TensorProto codes): row_types[slot]
      is the type of that slot's A, B^T and D rows in place of adapter_dtype, so one segment
      may compose slots of different types; None or [] (input absent or [0]): adapter_dtype
      for every slot.
    """
    types = _slot_types(row_types, adapter_dtype, len(a_offsets), "row_types")
    num_key = key_cache.size
    region = np.concatenate([key_cache.ravel(), value_cache.ravel()]).astype(np.float32)
    in_f, out_f = x.shape[1], y.shape[1]
    terms = segment_terms(seg_slots, comp_segs, comp_slots, comp_weights)
    dora = np.full(len(a_offsets), -1, np.int64) if dora_offsets is None else dora_offsets
    dora = dora if len(dora) else np.full(len(a_offsets), -1, np.int64)
    y_out = y.astype(np.float64)  # [T, out]

    def row(offsets, features: int, what: str, slot: int) -> np.ndarray:  # float64 [n, features]
        return np.stack(
            [_pool_row(region, num_key, int(o), features, what, types[slot]) for o in offsets]
        )

    for s, seg_terms in enumerate(terms):
        t0, t1 = int(seg_starts[s]), int(seg_starts[s + 1])
        dora_slots = [slot for slot, _ in seg_terms if dora[slot] >= 0]
        if dora_slots and len(seg_terms) > 1:
            raise ValueError(
                f"segment {s} composes {len(seg_terms)} adapters and slot {dora_slots[0]} is "
                f"DoRA (dora_offsets[{dora_slots[0]}] = {dora[dora_slots[0]]}): DoRA adapters "
                "cannot be composed"
            )
        active = [(slot, w) for slot, w in seg_terms if ranks[layer, slot] > 0]
        if not active or t0 == t1:
            continue
        for slot, w in active:
            rank = int(ranks[layer, slot])
            a = row(a_offsets[slot, :rank], in_f, "a_offset", slot)  # [r, in]
            bt = row(b_offsets[slot, :rank], out_f, "b_offset", slot)  # [r, out]
            shrunk = x[t0:t1].astype(np.float64) @ a.T  # [n, r]
            y_out[t0:t1] += float(w) * float(scales[layer, slot]) * (shrunk @ bt)  # [n, out]
        if dora_slots:
            d = row([dora[dora_slots[0]]], out_f, "dora_offset", dora_slots[0])  # [1, out]
            y_out[t0:t1] *= 1.0 + d
    return y_out.astype(np.float32)


@dataclass
class ModuleTables:
    """One module's inputs of a LoraSGMV call with several modules (attribute modules)."""

    y: np.ndarray  # float [T, out_m]
    a_offsets: np.ndarray  # int64 [num_slots, max_rank_m]
    b_offsets: np.ndarray  # int64 [num_slots, max_rank_m]
    ranks: np.ndarray  # int32 [num_layers, num_slots]
    scales: np.ndarray  # float [num_layers, num_slots]
    dora_offsets: np.ndarray | None = None  # int64 [num_slots] or [0]


def lora_sgmv_modules(
    modules: list[ModuleTables],
    x: np.ndarray,  # float [T, in]
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    seg_starts: np.ndarray,  # int32 [S + 1]
    seg_slots: np.ndarray,  # int32 [S]
    layer: int,
    adapter_dtype: str = "float32",
    *,
    comp_segs: np.ndarray | None = None,
    comp_slots: np.ndarray | None = None,
    comp_weights: np.ndarray | None = None,
    row_types: list[str] | None = None,
) -> list[np.ndarray]:
    """[y_out_m float32 [T, out_m]]: a LoraSGMV node with attribute modules = len(modules).

    Semantics: output m is lora_sgmv of module m's y, a_offsets, b_offsets, ranks, scales and
    dora_offsets with the shared x, caches, segments and composition entries, the same layer
    and row types (adapter_dtype, or row_types per slot). The modules read one x (q/k/v,
    gate/up); the node only shares the work.
    """
    shared = dict(x=x, key_cache=key_cache, value_cache=value_cache, seg_starts=seg_starts)
    shared |= dict(seg_slots=seg_slots, layer=layer, adapter_dtype=adapter_dtype)
    shared |= dict(comp_segs=comp_segs, comp_slots=comp_slots, comp_weights=comp_weights)
    shared |= dict(row_types=row_types)
    return [
        lora_sgmv(m.y, a_offsets=m.a_offsets, b_offsets=m.b_offsets, ranks=m.ranks,
                  scales=m.scales, dora_offsets=m.dora_offsets, **shared)
        for m in modules
    ]  # fmt: skip


def segment_terms(seg_slots, comp_segs=None, comp_slots=None, comp_weights=None) -> list:
    """[(slot, weight), ...] per segment: seg_slots[s] (weight 1) if >= 0, then the
    composition entries of segment s in order (see lora_sgmv's Semantics)."""
    terms = [[(int(slot), 1.0)] if slot >= 0 else [] for slot in seg_slots]
    if comp_segs is None:
        return terms
    for seg, slot, w in zip(comp_segs, comp_slots, comp_weights, strict=True):
        if not 0 <= seg < len(terms):
            raise ValueError(f"comp_segs entry {seg} must be in [0, {len(terms)})")
        if not np.isfinite(w):
            raise ValueError(f"comp_weights entry {w} is not finite")
        terms[int(seg)].append((int(slot), float(w)))
    return terms


def _aligned_full(n: int, value: float, align: int = 64) -> np.ndarray:
    """float32 [n] filled with value, starting on an `align`-byte boundary."""
    buf = np.empty(n + align // 4, dtype=np.float32)
    buf[...] = value
    skip = (-buf.ctypes.data % align) // 4
    return buf[skip : skip + n]


_BF16_NAN_PAIR_F32 = np.array(BF16_NAN_PAIR, np.uint32).view(np.float32)


def _write_row(dst: np.ndarray, values: np.ndarray, adapter_dtype: str) -> None:
    """Stores values [features] into the float32 pool elements dst as the row type."""
    if adapter_dtype == "float32":
        dst[...] = values
        return
    if adapter_dtype in HALF_TYPES:  # value halves only: an odd row's padding half stays NaN
        dst.view(np.uint16)[: values.size] = encode_rows(values, adapter_dtype).view("<u2")[
            : values.size
        ]
        return
    dst.view(np.uint32)[...] = encode_rows(values, adapter_dtype)


@dataclass
class PlacedAdapters:
    """Random adapters laid out in one layer's pool share (what LoraSGMV reads)."""

    key_cache: np.ndarray  # float32 [num_pages, block_size, kv_heads, head_dim]
    value_cache: np.ndarray  # float32 [num_pages, block_size, kv_heads, head_dim]
    a_offsets: np.ndarray  # int64 [num_slots, max_rank], -1 past each slot's rank
    b_offsets: np.ndarray  # int64 [num_slots, max_rank], -1 past each slot's rank
    dora_offsets: np.ndarray  # int64 [num_slots], -1 for slots without a DoRA row


def place_random_adapters(
    rng: np.random.Generator,
    slot_ranks: list[int],
    in_features: int,
    out_features: int,
    page_shape: tuple[int, int, int] = (16, 2, 16),
    max_gap: int = 3,
    adapter_dtype: str = "float32",
    dora_slots: list[int] = (),
    slot_dtypes: list[str] | None = None,
) -> PlacedAdapters:
    """Places slot s's A [slot_ranks[s], in] and B^T [slot_ranks[s], out] rows in a fresh pool,
    and for each slot in dora_slots one DoRA row D [out] (the op's m / ||W + sBA|| - 1).

    Rows go in shuffled order, each after a random gap of 0..max_gap elements (so rows start
    unaligned), filling key_cache and then value_cache; no row crosses from K into V. The rows
    hold random normal values scaled so that outputs are O(1) (DoRA rows: uniform in
    [-0.5, 0.5], scales 0.5..1.5); every other pool element is NaN, so a kernel that reads
    outside the rows it was given produces NaN. The pool starts on a 64-byte boundary (numpy
    alone gives 16), so max_gap=0 with row lengths that are multiples of 16 gives
    cache-line-aligned rows.
    page_shape is (block_size, kv_heads, head_dim).
    adapter_dtype="bfloat16": rows hold the values rounded to bfloat16 (nearest even), packed
    two per pool element; offsets and gaps count pool elements, a row of odd length ends with
    one bfloat16 of padding (NaN), and every other pool element is NaN in both halves.
    adapter_dtype="float16": as bfloat16, rounded to IEEE float16.
    adapter_dtype="int8": rows hold the values quantized per row (scale, then int8 values,
    the last element zero-padded).
    slot_dtypes: one row type per slot, in place of adapter_dtype (None: adapter_dtype for
    every slot): slot s's rows, its DoRA row too, are written as slot_dtypes[s] (what lora_sgmv's
    row_types reads); with any slot not float32, every other pool element is NaN in both halves.
    """
    types = _slot_types(slot_dtypes, adapter_dtype, len(slot_ranks), "slot_dtypes")
    if min(slot_ranks, default=0) < 0:
        raise ValueError(f"slot_ranks must be >= 0, got {slot_ranks}")
    rows = [(s, j, kind) for s, r in enumerate(slot_ranks) for j in range(r) for kind in "ab"]
    rows += [(s, 0, "d") for s in dora_slots]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    features = {"a": in_features, "b": out_features, "d": out_features}

    def length(s: int, kind: str) -> int:  # pool elements of slot s's row of `kind`
        return row_elems(features[kind], types[s])

    page_elems = int(np.prod(page_shape))
    needed = sum(length(s, kind) + max_gap for s, _, kind in rows) + max(in_features, out_features)
    num_pages = max(1, -(-needed // (2 * page_elems)) + 1)
    half = num_pages * page_elems
    nan = np.float32(np.nan) if set(types) <= {"float32"} else _BF16_NAN_PAIR_F32
    region = _aligned_full(2 * half, nan)  # 64-byte aligned, as ORT allocates tensors
    max_rank = max(slot_ranks, default=0)
    offsets = {kind: np.full((len(slot_ranks), max_rank), -1, np.int64) for kind in "ab"}
    offsets["d"] = np.full((len(slot_ranks), 1), -1, np.int64)
    cursor = 0
    for s, j, kind in rows:
        cursor += int(rng.integers(0, max_gap + 1))
        if cursor < half < cursor + length(s, kind):
            cursor = half  # the row would straddle K/V: start it at value_cache
        if kind == "d":
            values = rng.uniform(-0.5, 0.5, out_features)
        else:
            fan_in = in_features if kind == "a" else slot_ranks[s]
            values = rng.standard_normal(features[kind]) / np.sqrt(fan_in)
        _write_row(region[cursor : cursor + length(s, kind)], values, types[s])
        offsets[kind][s, j] = cursor
        cursor += length(s, kind)
    assert cursor <= region.size, "pool sized too small"
    shape = (num_pages, *page_shape)
    return PlacedAdapters(
        region[:half].reshape(shape),
        region[half:].reshape(shape),
        offsets["a"],
        offsets["b"],
        offsets["d"][:, 0],
    )
