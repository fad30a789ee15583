"""LoraSGMV CPU kernel vs the numpy reference (ort_lora/ops/lora_sgmv_ref.py).

Plain segments, DoRA segments (a DoRA row scales the segment's rows) and composed segments
(several weighted adapters over one segment's rows), mixed in one call with base rows. The
10-input node (no composition, no DoRA: what exports before them carry) and the 14-input node
both run. Every test runs for each adapter-row type: float32 pool elements (no attribute),
bfloat16 or float16 packed two per pool element (attribute adapter_dtype = 16 or 10), and int8
with a float32 scale first in each row (adapter_dtype = 3; ort_lora/adapter_rows.py). Every case
draws fresh random data from the `rng` fixture (seeded from the test id, the seed reported on
failure); the pool is NaN outside the adapter rows, so a kernel reading anywhere else fails the
comparison. The reference reads the same stored 16-bit / int8 values, so every row type shares the
float32-accumulation tolerance (int8: the kernel folds the rows' scales into the shrink scale).
Input 26, row_types, gives each slot its own row type in place of the attribute: pools holding
rows of all four types, read in one call (plain, composed, DoRA segments; three modules).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from rerun_with import assert_passes_with

import ort_lora
from ort_lora.adapter_rows import row_elems
from ort_lora.ops.lora_sgmv_ref import (
    ADAPTER_DTYPES,
    ModuleTables,
    lora_sgmv,
    lora_sgmv_modules,
    place_random_adapters,
)

INPUTS = [
    ("y", TensorProto.FLOAT, 2),
    ("x", TensorProto.FLOAT, 2),
    ("key_cache", TensorProto.FLOAT, 4),
    ("value_cache", TensorProto.FLOAT, 4),
    ("seg_starts", TensorProto.INT32, 1),
    ("seg_slots", TensorProto.INT32, 1),
    ("a_offsets", TensorProto.INT64, 2),
    ("b_offsets", TensorProto.INT64, 2),
    ("ranks", TensorProto.INT32, 2),
    ("scales", TensorProto.FLOAT, 2),
]
OPTIONAL_INPUTS = [  # composition entries [E] and DoRA rows [num_slots]
    ("comp_segs", TensorProto.INT32, 1),
    ("comp_slots", TensorProto.INT32, 1),
    ("comp_weights", TensorProto.FLOAT, 1),
    ("dora_offsets", TensorProto.INT64, 1),
]
# a further module's y, tables and DoRA rows (attribute modules), each named <name>_m
MODULE_INPUTS = [INPUTS[0], *INPUTS[6:], OPTIONAL_INPUTS[-1]]
NUM_MODULE_INPUTS = 2 * len(MODULE_INPUTS)  # inputs 14..25: modules 1 and 2's
ROW_TYPES = ("row_types", TensorProto.INT32, 1)  # input 26: int32 [num_slots] or [0]
# Adapter-row dtype -> kernel (float32 accumulation) vs float64 reference on the same row values.
RTOL = {"float32": 1e-5, "bfloat16": 1e-5, "float16": 1e-5, "int8": 1e-5}
# Adapter-row dtype -> node attributes: float32 rows are the default (no attribute).
ATTRS = {"float32": {}} | {t: {"adapter_dtype": ADAPTER_DTYPES[t]} for t in list(RTOL)[1:]}
# Adapter-row dtype -> how an out-of-range error counts a row's length.
ROW_UNIT = {"float32": "elements", "bfloat16": "bfloat16", "float16": "float16",
            "int8": r"int8 \(scale first"}  # fmt: skip
each_dtype = pytest.mark.parametrize("dtype", list(RTOL))
TYPES = list(ADAPTER_DTYPES)  # row type names, row_types' TensorProto codes by name
TYPE_NAMES = {code: name for name, code in ADAPTER_DTYPES.items()}


def make_session(
    layer: int,
    input_types: dict[str, int] | None = None,
    shapeless: bool = False,
    optional: tuple[str, ...] = (),
    modules: int = 1,
    **attrs,
) -> ort.InferenceSession:
    """A one-node LoraSGMV model; input_types overrides declared input element types;
    shapeless declares no input ranks (so the op itself, not ORT, checks them); optional names
    the optional inputs the node has (OPTIONAL_INPUTS' and row_types; the others are left out:
    ""); modules > 1: attribute modules, modules 1.. inputs <name>_m and outputs y_out_m;
    attrs are further node attributes (adapter_dtype)."""
    further = [(f"{n}_{m}", t, r) for m in range(1, modules) for n, t, r in MODULE_INPUTS]
    row_types = [ROW_TYPES] if ROW_TYPES[0] in optional else []
    used = INPUTS + [i for i in OPTIONAL_INPUTS if i[0] in optional] + further + row_types
    types = {name: t for name, t, _ in used} | (input_types or {})
    graph_inputs = [
        helper.make_tensor_value_info(name, types[name], None if shapeless else [None] * rank)
        for name, _, rank in used
    ]
    names = [n for n, _, _ in INPUTS]
    if len(used) > len(INPUTS):
        names += [n if n in optional else "" for n, _, _ in OPTIONAL_INPUTS]
    names += [n for n, _, _ in further]
    if row_types:
        names += [""] * (NUM_MODULE_INPUTS - len(further)) + [ROW_TYPES[0]]
    outputs = ["y_out"] + [f"y_out_{m}" for m in range(1, modules)]
    if modules > 1:
        attrs["modules"] = modules
    node = helper.make_node(
        "LoraSGMV",
        names,
        outputs,
        domain=ort_lora.OPS_DOMAIN,
        layer=layer,
        **attrs,
    )
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None, None]) for o in outputs]
    graph = helper.make_graph([node], "lora_sgmv", graph_inputs, outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    opts = ort_lora.session_options(intra_op_num_threads=2)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


ALL_OPTIONAL = tuple(n for n, _, _ in OPTIONAL_INPUTS)
_SESSIONS: dict[tuple[int, str, bool, bool], ort.InferenceSession] = {}


def session(
    layer: int = 0, adapter_dtype: str = "float32", full: bool = False, row_types: bool = False
):
    """The cached one-node model of `layer` with adapter rows of type adapter_dtype; full: the
    node has all 14 inputs, else the 10 required ones; row_types: input 26 too."""
    key = (layer, adapter_dtype, full, row_types)
    if key not in _SESSIONS:
        optional = (ALL_OPTIONAL if full else ()) + ((ROW_TYPES[0],) if row_types else ())
        _SESSIONS[key] = make_session(layer, optional=optional, **ATTRS[adapter_dtype])
    return _SESSIONS[key]


def session_for(feeds, dtype, layer=0):
    """session() of the inputs make_case gave: the 14-input node for composition / DoRA cases,
    with row_types where the case has them."""
    return session(layer, dtype, full="dora_offsets" in feeds, row_types="row_types" in feeds)


def make_case(rng, dtype, seg_lens, seg_slots, slot_ranks, in_f=64, out_f=192, layer_ranks=None,
              comp=None, dora_slots=(), slot_dtypes=None):  # fmt: skip
    """Feeds for one call; dtype is the adapter rows' type in the pool; layer_ranks
    [num_layers, num_slots] defaults to slot_ranks. comp: composition entries [(segment, slot,
    weight)] and dora_slots: the slots with a DoRA row; either one makes a 14-input case.
    slot_dtypes: each slot's row type in place of dtype, fed as row_types (input 26)."""
    rows = dict(adapter_dtype=dtype, dora_slots=list(dora_slots), slot_dtypes=slot_dtypes)
    placed = place_random_adapters(rng, list(slot_ranks), in_f, out_f, **rows)
    ranks = np.array(layer_ranks if layer_ranks is not None else [slot_ranks], np.int32)
    num_rows = int(sum(seg_lens))
    optional = {}
    if slot_dtypes is not None:
        optional["row_types"] = np.array([ADAPTER_DTYPES[t] for t in slot_dtypes], np.int32)
    if comp is not None or dora_slots:
        segs, slots, weights = zip(*comp) if comp else ((), (), ())
        optional |= {
            "comp_segs": np.array(segs, np.int32),
            "comp_slots": np.array(slots, np.int32),
            "comp_weights": np.array(weights, np.float32),
            "dora_offsets": placed.dora_offsets,
        }
    return optional | {
        "y": rng.standard_normal((num_rows, out_f)).astype(np.float32),
        "x": rng.standard_normal((num_rows, in_f)).astype(np.float32),
        "key_cache": placed.key_cache,
        "value_cache": placed.value_cache,
        "seg_starts": np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32),
        "seg_slots": np.array(seg_slots, np.int32),
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": ranks.reshape(-1, len(slot_ranks)),
        "scales": rng.uniform(0.25, 2.0, ranks.shape).astype(np.float32),
    }


def assert_close(got, ref, dtype):
    scale = float(np.abs(ref).max()) if ref.size else 1.0
    np.testing.assert_allclose(got, ref, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


def reference(feeds, dtype, layer=0):
    """lora_sgmv of a case's feeds, their row_types (TensorProto codes) given as type names."""
    row_types = [TYPE_NAMES[int(code)] for code in feeds.get("row_types", ())]
    return lora_sgmv(**dict(feeds, row_types=row_types), layer=layer, adapter_dtype=dtype)


def check(feeds, dtype, layer=0):
    got = session_for(feeds, dtype, layer).run(None, feeds)[0]
    ref = reference(feeds, dtype, layer)
    assert got.shape == ref.shape
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("in_f,out_f", [(64, 192), (576, 1536)])
@pytest.mark.parametrize("rank", [1, 4, 16, 64])
@each_dtype
def test_ranks(dtype, rank, in_f, out_f, rng):
    check(make_case(rng, dtype, [5, 3, 9, 1], [0, -1, 1, 0], [rank, rank], in_f, out_f), dtype)


@each_dtype
def test_mixed_ranks_in_one_call(dtype, rng):
    slot_ranks = [1, 8, 16, 64, 3, 0]
    seg_lens, seg_slots = [6, 2, 11, 4, 7, 1, 3], [0, 1, 2, 3, 4, 5, -1]
    check(make_case(rng, dtype, seg_lens, seg_slots, slot_ranks, 576, 1536), dtype)


@each_dtype
def test_decode_segments_of_one_and_two_rows(dtype, rng):
    """Decode's segments (one or two rows) over ranks that take the shrink's groups of 8 rows
    of A with every remainder (a group of 4, single rows) and ranks under 8."""
    slot_ranks = [16, 13, 9, 7, 8, 12, 3, 1]
    seg_lens, seg_slots = [2, 1, 2, 1, 2, 2, 1, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, -1]
    check(make_case(rng, dtype, seg_lens, seg_slots, slot_ranks, 576, 1536), dtype)


def _zipf_layout(rng, num_rows, num_slots):
    """Skewed adapter popularity: rows per slot ~ Zipf, segments ordered by slot."""
    weights = 1.0 / np.arange(1, num_slots + 1) ** 1.2
    counts = np.bincount(
        rng.choice(num_slots, num_rows, p=weights / weights.sum()), minlength=num_slots
    )
    slots = [s for s in range(num_slots) if counts[s]]
    return [int(counts[s]) for s in slots], slots


LAYOUTS = {
    "all_base": lambda rng: ([7, 5], [-1, -1], [4, 8]),
    "one_adapter": lambda rng: ([13], [1], [4, 8]),
    "every_row_distinct": lambda rng: ([1] * 24, list(range(24)), [16] * 24),
    "skewed": lambda rng: (*_zipf_layout(rng, 40, 8), [16, 8, 4, 16, 1, 32, 16, 2]),
    "repeated_slot_and_empty_segments": lambda rng: ([3, 0, 4, 2, 0], [0, 1, 0, -1, 1], [4, 8]),
    "t0": lambda rng: ([0], [0], [4]),
    "t0_no_segments": lambda rng: ([], [], [4]),
    "t1": lambda rng: ([1], [0], [16]),
    "t_over_1000": lambda rng: ([300, 1, 517, 250, 33], [0, -1, 1, 2, 3], [16, 4, 64, 1]),
}


def halves_used(feeds) -> set[str]:
    """Which caches hold the case's used A rows."""
    half = feeds["key_cache"].size
    used = feeds["a_offsets"][feeds["a_offsets"] >= 0]
    return {"key" if o < half else "value" for o in used}


def case_in_both_caches(rng, *case, draws=30):
    """make_case(rng, *case) redrawn until its A rows lie in key_cache and value_cache both:
    slot ranks summing to >= 16 fill key_cache, but one just over it (t1) spills only its last
    row or two, A or B^T rows by chance."""
    for _ in range(draws):
        feeds = make_case(rng, *case)
        if halves_used(feeds) == {"key", "value"}:
            return feeds
    raise AssertionError(f"no draw of {draws} put A rows in both caches")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@each_dtype
def test_segment_layouts(dtype, layout, rng):
    """Decode (one row per adapter) and prefill (segments of >= 8 rows: the baseline kernels
    widen 16-bit and int8 rows once per call, the others as they load) layouts; with >= 16
    rows, rows in K and V."""
    seg_lens, seg_slots, slot_ranks = LAYOUTS[layout](rng)
    # int8 rows take a quarter of the pool elements: 4x the features fill key_cache as well
    widths = (256, 768) if dtype == "int8" else (64, 192)
    case = (dtype, seg_lens, seg_slots, slot_ranks, *widths)
    feeds = case_in_both_caches(rng, *case) if sum(slot_ranks) >= 16 else make_case(rng, *case)
    check(feeds, dtype)


@pytest.mark.parametrize(
    "in_f,out_f",
    [(64, 192), (192, 64), (576, 1536), (37, 53), (15, 3), (1, 1), (33, 2049)],
)
@each_dtype
def test_heterogeneous_shapes(dtype, in_f, out_f, rng):
    """Odd feature counts end bfloat16 rows with a padding bfloat16; gaps give odd pool offsets
    (float32 rows off a 64-bit boundary, bfloat16 rows starting in the second half of a pair
    of pool elements)."""
    feeds = make_case(rng, dtype, [1, 6, 9, 2], [2, 0, 1, -1], [16, 5, 3], in_f, out_f)
    assert (feeds["a_offsets"] % 2 == 1).any() and (feeds["b_offsets"] % 2 == 1).any()
    check(feeds, dtype)


@each_dtype
def test_layer_attribute_selects_ranks_and_scales(dtype, rng):
    layer_ranks = [[4, 8, 2], [8, 0, 2], [1, 8, 0]]  # slot 1 has no adapter in layer 1
    for layer in (1, 2):
        feeds = make_case(rng, dtype, [5, 4, 6], [0, 1, 2], [8, 8, 2], layer_ranks=layer_ranks)
        check(feeds, dtype, layer)


@each_dtype
def test_unused_slot_offsets_are_not_read(dtype, rng):
    feeds = make_case(rng, dtype, [4, 3], [0, -1], [4, 4])
    feeds["a_offsets"][1] = -7  # slot 1 is used by no segment
    feeds["b_offsets"][1] = 10**12
    check(feeds, dtype)


@pytest.mark.parametrize("in_f", [64, 37])
def test_float16_rows_widen_every_magnitude_exactly(in_f, rng):
    """float16 rows holding values from subnormals (2^-24) to 2^16, either sign: decode rows
    (converted as loaded, 16 or 8 lanes at a time), a prefill segment (as loaded; the
    baseline kernels widen it once per call) and odd lengths (the scalar tail) all read the
    values the reference decodes."""
    feeds = make_case(rng, "float16", [1, 1, 12, 1], [0, 1, 2, -1], [8, 4, 16], in_f, 96)
    halves = [feeds[c].reshape(-1).view("<u2") for c in ("key_cache", "value_cache")]
    size = feeds["key_cache"].size
    for table, n in (("a_offsets", in_f), ("b_offsets", 96)):
        for o in feeds[table][feeds[table] >= 0]:
            exponent = rng.integers(0, 32, n) % 31  # 0: subnormal (or zero); never inf / NaN
            bits = (rng.integers(0, 2, n) << 15) | (exponent << 10) | rng.integers(0, 1024, n)
            start = 2 * (int(o) % size)
            halves[int(o) >= size][start : start + n] = bits.astype(np.uint16)
    feeds["x"] *= 2.0**-8  # products of 2^16-scale A values stay far from float32's limits
    check(feeds, "float16")


def move_row(feeds, dtype, table, slot, j, features, new_offset):
    """Copies one row's pool elements to new_offset (NaN there before) and points the table
    at it."""
    region = [feeds["key_cache"].reshape(-1), feeds["value_cache"].reshape(-1)]
    half, old = region[0].size, int(feeds[table][slot, j])
    n = row_elems(features, dtype)
    src = region[old >= half][old % half : old % half + n].copy()
    dst = region[new_offset >= half][new_offset % half : new_offset % half + n]
    assert np.isnan(dst).all(), "the target elements must be free"
    dst[...] = src
    feeds[table][slot, j] = new_offset


@each_dtype
def test_rows_ending_at_the_end_of_each_cache(dtype, rng):
    """Rows whose last pool element is the last of key_cache / value_cache: for bfloat16 rows
    of odd length, its padding bfloat16 is the last one."""
    feeds = make_case(rng, dtype, [3, 4], [0, 1], [4, 4], in_f=37, out_f=53)
    half = feeds["key_cache"].size
    move_row(feeds, dtype, "b_offsets", 1, 2, 53, 2 * half - row_elems(53, dtype))
    move_row(feeds, dtype, "a_offsets", 0, 3, 37, half - row_elems(37, dtype))
    check(feeds, dtype)


def test_adapter_dtype_1_is_float32_rows(rng):
    feeds = make_case(rng, "float32", [4, 1, 6], [1, -1, 0], [8, 16])
    got = make_session(0, adapter_dtype=1).run(None, feeds)[0]
    assert_close(got, lora_sgmv(**feeds, layer=0), "float32")


@pytest.mark.parametrize("table,features", [("a_offsets", 37), ("b_offsets", 53)])
@each_dtype
def test_row_overrunning_its_half(dtype, table, features, rng):
    """A row one pool element too long for the room left in key_cache (A) or value_cache
    (B^T): 37 bfloat16 span 19 pool elements, so at half - 18 (18.5 elements would fit)."""
    feeds = make_case(rng, dtype, [3, 4], [0, 1], [4, 4], in_f=37, out_f=53)
    half = feeds["key_cache"].size
    end = half if table == "a_offsets" else 2 * half
    offset = end - row_elems(features, dtype) + 1
    feeds[table][1, 2] = offset
    unit = ROW_UNIT[dtype]
    expected = rf"{table}\[1, 2\] = {offset} is an out-of-range page: a row of {features} {unit}"
    with pytest.raises(Exception, match=expected):
        session(0, dtype).run(None, feeds)


@pytest.mark.parametrize("value", [0, 11, 2, 5])
def test_bad_adapter_dtype_attribute(value):
    expected = rf"attribute 'adapter_dtype' = {value} is not supported by the CPU op: it must be 1"
    with pytest.raises(Exception, match=expected):
        make_session(0, adapter_dtype=value)


def test_adapter_dtype_attribute_of_the_wrong_type():
    with pytest.raises(Exception, match="attribute 'adapter_dtype' must be an int"):
        make_session(0, adapter_dtype=16.0)
    with pytest.raises(Exception, match="attribute 'adapter_dtype' must be an int"):
        make_session(0, adapter_dtype="bfloat16")


# ---- DoRA and composed segments ---------------------------------------------------------------

# (seg_lens, seg_slots, composition entries (segment, slot, weight), DoRA slots). Slot ranks
# come from the test; every layout mixes base rows, plain LoRA, DoRA and composed segments.
MIXES = {
    "decode": ([1, 1, 1, 1, 1, 1, 1], [0, 1, -1, 2, -1, 0, 3],
               [(4, 0, 0.7), (4, 2, 0.3), (5, 2, -0.5)], [1, 3]),
    "prefill": ([17, 9, 33, 12, 8], [1, -1, 0, 2, 3],
                [(1, 0, 0.6), (1, 2, 0.4), (3, 0, 1.5)], [1, 3]),
    "mixed": ([1, 20, 0, 3, 11, 1, 2], [3, 0, -1, -1, -1, 2, 1],
              [(3, 3, 0.8), (4, 0, 0.25), (4, 2, 0.5), (4, 2, 0.25), (2, 0, 2.0)], [1, 3]),
}  # fmt: skip


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("rank", [1, 8, 64])
@each_dtype
def test_dora_and_composed_segments(dtype, rank, mix, rng):
    """Slots 1 and 3 are DoRA (mixed: slot 3 also as one weighted term, 0.8); slots 0 and 2
    are composed with weights (negative, repeated too), beside base and plain rows."""
    seg_lens, seg_slots, comp, dora = MIXES[mix]
    ranks = [rank, max(1, rank // 2), 3, rank]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, ranks, 96, 160, comp=comp, dora_slots=dora)
    check(feeds, dtype)


Y_FROM_NODE_CASES = {
    "prefill": ([6, 5, 300, 2], [0, -1, 1, 0], None, ()),
    "decode": ([1] * 12, [0, 1, 2, 3, -1, 0, 1, 2, 3, 1, 1, 0], None, ()),
    "no_adapter": ([1, 1, 5], [-1, -1, -1], None, ()),
} | MIXES


@pytest.mark.parametrize("case", list(Y_FROM_NODE_CASES))
@each_dtype
def test_y_produced_by_another_node(dtype, case, rng):
    """y = 2 * y_in and the output doubled again: y and y_out are intermediate tensors, as in
    an exported model, so ORT runs the op in place (MayInplace; the op infers y_out's shape
    from y's): every kind of row (without an adapter, prefill and decode segments, composed,
    DoRA) reads y before it writes y_out over it."""
    seg_lens, seg_slots, comp, dora = Y_FROM_NODE_CASES[case]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, [8, 16, 3, 8], comp=comp, dora_slots=dora)
    used = INPUTS + (OPTIONAL_INPUTS if "dora_offsets" in feeds else [])
    names = [n for n, _, _ in used]
    vis = [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in used]
    vis[0] = helper.make_tensor_value_info("y_in", TensorProto.FLOAT, ["T", "out"])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [
        helper.make_node("Mul", ["y_in", "two"], ["y"]),
        helper.make_node(
            "LoraSGMV", names, ["y_mid"], domain=ort_lora.OPS_DOMAIN, layer=0, **ATTRS[dtype]
        ),
        helper.make_node("Mul", ["y_mid", "two"], ["y_out"]),
    ]
    out = helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [None, None])
    graph = helper.make_graph(nodes, "y_from_node", vis, [out], initializer=[two])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    sess = ort.InferenceSession(
        model.SerializeToString(), ort_lora.session_options(intra_op_num_threads=2)
    )
    y_in = feeds.pop("y")
    got = sess.run(None, {"y_in": y_in, **feeds})[0]
    want = lora_sgmv(2 * y_in, **feeds, layer=0, adapter_dtype=dtype)
    assert_close(got / 2, want, dtype)


@each_dtype
def test_dora_rows_scale_only_their_segments(dtype, rng):
    """Rows of plain and base segments equal the call without DoRA rows, bit for bit; the DoRA
    segment's rows are (y + delta) * (1 + D), D read from its row."""
    feeds = make_case(rng, dtype, [6, 4, 9, 2], [0, 1, -1, 1], [8, 4], dora_slots=[1])
    got = session(0, dtype, full=True).run(None, feeds)[0]
    plain = dict(feeds, dora_offsets=np.zeros(0, np.int64))
    without = session(0, dtype, full=True).run(None, plain)[0]
    dora_rows = np.zeros(21, bool)
    dora_rows[6:10] = dora_rows[19:21] = True
    np.testing.assert_array_equal(got[~dora_rows], without[~dora_rows])
    assert np.abs(got[dora_rows] - without[dora_rows]).max() > 0.05
    check(feeds, dtype)


@each_dtype
def test_composition_is_the_weighted_sum_of_single_adapter_calls(dtype, rng):
    """0.7 a + 0.3 b over a segment == y + 0.7 (call with a alone - y) + 0.3 (b alone - y), the
    single-adapter calls through the 10-input node: the weighted sum of the deltas."""
    comp = [(0, 0, 0.7), (0, 1, 0.3), (1, 0, 0.7), (1, 1, 0.3)]
    feeds = make_case(rng, dtype, [5, 12], [-1, -1], [4, 6], comp=comp)
    got = session(0, dtype, full=True).run(None, feeds)[0]
    plain = {k: v for k, v in feeds.items() if k not in ALL_OPTIONAL}
    alone = [
        session(0, dtype).run(None, dict(plain, seg_slots=np.array([s, s], np.int32)))[0]
        for s in (0, 1)
    ]
    y = feeds["y"]
    assert_close(got, y + 0.7 * (alone[0] - y) + 0.3 * (alone[1] - y), dtype)
    check(feeds, dtype)


@each_dtype
def test_optional_inputs_left_out_or_empty(dtype, rng):
    """The 14-input node with no composition entries and no DoRA rows ([0]), and a node with
    only dora_offsets, equal the 10-input node."""
    feeds = make_case(rng, dtype, [3, 8, 2], [0, 1, -1], [4, 16], comp=[])
    feeds["dora_offsets"] = np.zeros(0, np.int64)
    plain = {k: v for k, v in feeds.items() if k not in ALL_OPTIONAL}
    want = session(0, dtype).run(None, plain)[0]
    np.testing.assert_array_equal(session(0, dtype, full=True).run(None, feeds)[0], want)
    only_dora = make_session(0, optional=("dora_offsets",), **ATTRS[dtype])
    got = only_dora.run(None, dict(plain, dora_offsets=np.full(2, -1, np.int64)))[0]
    np.testing.assert_array_equal(got, want)


@each_dtype
def test_a_composed_term_of_rank_0_at_the_layer(dtype, rng):
    """Layer 1: slots 1 and 2 have rank 0, so segment 0 (slots 0 + 1) adds slot 0's share
    alone, and segments 1 (slot 1) and 2 (slot 2, DoRA: its row unread) are left as y."""
    layer_ranks = [[4, 8, 2], [4, 0, 0]]
    feeds = make_case(rng, dtype, [6, 5, 3], [0, 1, 2], [4, 8, 2], layer_ranks=layer_ranks,
                      comp=[(0, 1, 0.5)], dora_slots=[2])  # fmt: skip
    check(feeds, dtype, layer=1)
    got = session(1, dtype, full=True).run(None, feeds)[0]
    np.testing.assert_array_equal(got[6:], feeds["y"][6:])


# ---- row_types: a row type per slot (input 26) -----------------------------------------------

# (seg_lens, seg_slots) over 8 slots, slot s of type TYPES[s % 4]: decode segments of 1-2 rows,
# prefill segments of >= 8 rows, base rows (-1); "mixed" reads slot 1 in both kinds of segment.
MIXED_TYPE_LAYOUTS = {
    "decode": ([1, 2, 1, 1, 2, 1, 1, 1, 2, 1], [0, 1, 2, 3, -1, 4, 5, 6, 7, 1]),
    "prefill": ([9, 17, 8, 12, 10, 8], [3, 2, 1, 0, -1, 6]),
    "mixed": ([1, 12, 2, 9, 1, 3, 1, 8, 2, 1, 11], [0, 1, 3, 2, -1, -1, 5, 4, 1, 6, 7]),
}


@pytest.mark.parametrize("in_f,out_f", [(64, 192), (37, 53), (576, 1536)])
@pytest.mark.parametrize("layout", list(MIXED_TYPE_LAYOUTS))
@each_dtype
def test_mixed_row_types_in_one_call(dtype, layout, in_f, out_f, rng):
    """Slots of all four row types in one pool and one call, whatever the attribute (dtype):
    each slot's rows are read as row_types says (a slot read as another type reads NaN
    padding or wrong values); rows fill key_cache and value_cache."""
    seg_lens, seg_slots = MIXED_TYPE_LAYOUTS[layout]
    feeds = make_case(rng, dtype, seg_lens, seg_slots, [16, 8, 4, 1, 64, 3, 16, 8], in_f, out_f,
                      slot_dtypes=TYPES * 2)  # fmt: skip
    assert halves_used(feeds) == {"key", "value"}
    check(feeds, dtype)


@pytest.mark.parametrize("seg_lens", [[1, 2, 1, 1], [9, 12, 8, 10]], ids=["decode", "prefill"])
@each_dtype
def test_mixed_row_types_composed(dtype, seg_lens, rng):
    """Segments composing slots of different types (slot s of type TYPES[s]) equal y plus the
    weighted deltas of each slot alone through a one-type node (attribute = the slot's type),
    and the reference."""
    comp = [(0, 0, 0.7), (0, 1, 0.3), (1, 3, -0.5), (1, 1, 0.25), (2, 3, 1.5), (2, 2, 0.5)]
    feeds = make_case(rng, dtype, seg_lens, [-1, 2, -1, -1], [8, 4, 16, 2], 96, 160, comp=comp,
                      slot_dtypes=TYPES)  # fmt: skip
    check(feeds, dtype)
    plain = {k: v for k, v in feeds.items() if k in {n for n, _, _ in INPUTS}}
    y, starts, want = feeds["y"], feeds["seg_starts"], feeds["y"].copy()
    for seg, slot, w in [(1, 2, 1.0), *comp]:
        alone = session(0, TYPES[slot]).run(None, dict(plain, seg_slots=np.full(4, slot, np.int32)))
        rows = slice(starts[seg], starts[seg + 1])
        want[rows] += w * (alone[0][rows] - y[rows])
    assert_close(session_for(feeds, dtype).run(None, feeds)[0], want, dtype)


@pytest.mark.parametrize("dora_type", ["bfloat16", "float16"])
@each_dtype
def test_mixed_row_types_dora_slot_of_a_16_bit_type(dtype, dora_type, rng):
    """Slot 1 (dora_type) and slot 3 (float32) are DoRA, beside float32 slots 0 and 2 (one
    segment composes them): slot 1's D row is read as dora_type, in decode and prefill
    segments."""
    slot_dtypes = ["float32", dora_type, "float32", "float32"]
    feeds = make_case(rng, dtype, [1, 9, 2, 3, 12, 1], [1, 1, 0, -1, 2, 3], [8, 4, 16, 8], 96, 160,
                      comp=[(2, 2, 0.5)], dora_slots=[1, 3], slot_dtypes=slot_dtypes)  # fmt: skip
    check(feeds, dtype)
    sess = session_for(feeds, dtype)
    without = sess.run(None, dict(feeds, dora_offsets=np.zeros(0, np.int64)))[0]
    assert np.abs(sess.run(None, feeds)[0][:10] - without[:10]).max() > 0.05  # slot 1's rows


def modules_case(rng, dtype, seg_lens, seg_slots, slot_ranks, comp, dora_slots, slot_dtypes):
    """Feeds of a node of len(slot_ranks) modules of n = len(slot_dtypes) slots: make_case's
    of modules * n slots cut in n, module m's tables those of slots m n .. m n + n - 1 (ranks
    slot_ranks[m], DoRA rows for dora_slots[m]), each module its own y, row_types n entries."""
    n, modules = len(slot_dtypes), len(slot_ranks)
    dora = [m * n + s for m, slots in enumerate(dora_slots) for s in slots]
    flat = make_case(rng, dtype, seg_lens, seg_slots, sum(slot_ranks, []), comp=comp,
                     dora_slots=dora, slot_dtypes=slot_dtypes * modules)  # fmt: skip

    def tables(m: int) -> dict:
        cut = slice(m * n, (m + 1) * n)
        rows = {k: flat[k][cut] for k in ("a_offsets", "b_offsets", "dora_offsets")}
        return rows | {k: flat[k][:, cut] for k in ("ranks", "scales")}

    feeds = flat | tables(0) | {"row_types": flat["row_types"][:n]}
    for m in range(1, modules):
        feeds |= {f"{k}_{m}": v for k, v in tables(m).items()}
        feeds[f"y_{m}"] = rng.standard_normal(flat["y"].shape).astype(np.float32)
    return {k: np.ascontiguousarray(v) for k, v in feeds.items()}


@each_dtype
def test_mixed_row_types_three_modules(dtype, rng):
    """A node of attribute modules = 3 with row_types (slot s of type TYPES[s] in every
    module): output m is lora_sgmv_modules'. Slot 1 (bfloat16) is DoRA in modules 0 and 2
    and has no rows in module 1, slot 2 none in module 2; segments 3 and 6 compose types."""
    feeds = modules_case(rng, dtype, [1, 9, 2, 1, 12, 1, 2], [0, 1, 2, -1, 3, 1, -1],
                         [[8, 4, 16, 2], [8, 0, 16, 4], [4, 4, 0, 2]],
                         comp=[(3, 0, 0.7), (3, 3, 0.3), (6, 2, -0.5), (6, 0, 0.5)],
                         dora_slots=[[1], [], [1]], slot_dtypes=TYPES)  # fmt: skip
    optional = (*ALL_OPTIONAL, ROW_TYPES[0])
    got = make_session(0, optional=optional, modules=3, **ATTRS[dtype]).run(None, feeds)
    names = [n for n, _, _ in MODULE_INPUTS]
    modules = [ModuleTables(*(feeds[f"{n}_{m}" if m else n] for n in names)) for m in range(3)]
    shared = {k: feeds[k] for k in ("x", "key_cache", "value_cache", "seg_starts", "seg_slots")}
    shared |= {k: feeds[k] for k in ALL_OPTIONAL[:3]}
    row_types = [TYPE_NAMES[int(code)] for code in feeds["row_types"]]
    want = lora_sgmv_modules(modules, **shared, layer=0, adapter_dtype=dtype, row_types=row_types)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, dtype)


@each_dtype
def test_row_types_of_shape_0_are_the_attribute(dtype, rng):
    """row_types [0] gives the node without row_types, bit for bit; row_types naming one type
    for every slot gives that type's one-type node, whatever the attribute."""
    feeds = make_case(rng, dtype, [1, 9, 2, 3], [0, 1, -1, 1], [8, 4], comp=[(2, 0, 0.5)],
                      dora_slots=[1])  # fmt: skip
    want = session(0, dtype, full=True).run(None, feeds)[0]
    empty = dict(feeds, row_types=np.zeros(0, np.int32))
    np.testing.assert_array_equal(session_for(empty, dtype).run(None, empty)[0], want)
    check(empty, dtype)
    for row_type in TYPES:
        case = (rng, row_type, [1, 9, 2, 3], [0, 1, -1, 1], [8, 4])
        feeds = make_case(*case, comp=[(2, 0, 0.5)], dora_slots=[1], slot_dtypes=[row_type] * 2)
        got = session_for(feeds, dtype).run(None, feeds)[0]
        without = {k: v for k, v in feeds.items() if k != "row_types"}
        one_type = session(0, row_type, full=True).run(None, without)[0]
        assert_close(got, one_type, row_type)
        check(feeds, dtype)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_narrower_isa_kernels(isa):
    """The AVX2 and baseline kernels (forced with ORT_LORA_SGMV_ISA) pass the value tests."""
    cases = (
        "ranks or layouts or shapes or layer_attribute_selects or end_of_each_cache or dora or "
        "every_magnitude or mixed_row_types"
    )
    assert_passes_with(__file__, cases, "ORT_LORA_SGMV_ISA", isa)


# ---- validation: every bad input gives an error naming it -------------------------------------


def run_expect_error(feeds, match, dtype, layer=0):
    with pytest.raises(Exception, match=match):
        session_for(feeds, dtype, layer).run(None, feeds)


def valid_feeds(rng, dtype):
    return make_case(rng, dtype, [3, 2, 4], [0, -1, 1], [4, 4])


@pytest.mark.parametrize("name", ["y", "x", "key_cache", "seg_slots", "a_offsets", "scales"])
@each_dtype
def test_bad_input_rank(dtype, name, rng):
    feeds = valid_feeds(rng, dtype)
    feeds[name] = feeds[name][..., None]
    expected = {n: r for n, _, r in INPUTS}[name]
    with pytest.raises(Exception, match=f"input '{name}' must have rank {expected}, got shape"):
        make_session(0, shapeless=True, **ATTRS[dtype]).run(None, feeds)  # the op's own check
    with pytest.raises(Exception, match=f"Invalid rank for input: {name}"):
        session(0, dtype).run(None, feeds)  # declared ranks: ORT refuses first


@pytest.mark.parametrize("name", ["x", "seg_starts", "a_offsets", "scales"])
@each_dtype
def test_bad_input_dtype(dtype, name):
    # The op declares every input's element type, so ORT refuses a mismatch at load time.
    with pytest.raises(Exception, match=rf"Type 'tensor\(double\)' of input parameter \({name}\)"):
        make_session(0, {name: TensorProto.DOUBLE}, **ATTRS[dtype])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: f.update(x=f["x"][:-1]), r"input 'x' dim 0 must be 9"),
        (lambda f: f.update(seg_starts=f["seg_starts"] + 1), r"seg_starts\[0\] must be 0"),
        (lambda f: f["seg_starts"].__setitem__(-1, 8), r"seg_starts\[3\] must be T = 9"),
        (lambda f: f["seg_starts"].__setitem__(1, 6), "non-monotonic"),
        (lambda f: f.update(seg_slots=f["seg_slots"][:2]), r"input 'seg_starts' dim 0 must be 3"),
        (lambda f: f["seg_slots"].__setitem__(1, 2), r"seg_slots\[1\] = 2 must be in \[-1, 2\)"),
        (lambda f: f["seg_slots"].__setitem__(1, -2), r"seg_slots\[1\] = -2"),
        (lambda f: f["ranks"].__setitem__((0, 1), 5), r"ranks\[0, 1\] = 5 must be in \[0, 4\]"),
        (lambda f: f["ranks"].__setitem__((0, 0), -1), r"ranks\[0, 0\] = -1"),
        (
            lambda f: f["a_offsets"].__setitem__((0, 2), -3),
            r"a_offsets\[0, 2\] = -3.*out-of-range page",
        ),
        (
            lambda f: f["b_offsets"].__setitem__((1, 3), 2 * f["key_cache"].size - 10),
            r"b_offsets\[1, 3\].*out-of-range page",
        ),
        (
            lambda f: f["a_offsets"].__setitem__((1, 0), f["key_cache"].size - 5),
            r"a_offsets\[1, 0\].*out-of-range page",
        ),
        (lambda f: f["a_offsets"].__setitem__((0, 1), 2**62), r"a_offsets\[0, 1\] = 4611"),
        (lambda f: f["b_offsets"].__setitem__((0, 0), 2**63 - 2), r"b_offsets\[0, 0\].*range page"),
        (lambda f: f.update(value_cache=f["value_cache"][:-1]), "input 'value_cache' dim 0"),
        (lambda f: f.update(scales=f["scales"][:, :1]), "input 'scales' dim 1"),
        (lambda f: f.update(b_offsets=f["b_offsets"][:, :2]), "input 'b_offsets' dim 1"),
        (lambda f: f.update(ranks=f["ranks"][:, :1]), r"input 'ranks' dim 1 must be 2 \(num_slots"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
@each_dtype
def test_bad_inputs(dtype, mutate, match, rng):
    feeds = valid_feeds(rng, dtype)
    mutate(feeds)
    run_expect_error(feeds, match, dtype)


def no_adapter_feeds(rng, dtype):
    """valid_feeds' rows without an adapter: every seg_slots entry -1, no composition."""
    feeds = valid_feeds(rng, dtype)
    feeds["seg_slots"][:] = -1
    return feeds


# Tables that fail a call whose segments use them (test_bad_inputs)
UNUSED_BAD_TABLES = {
    "a_offsets out of range": lambda f: f["a_offsets"].__setitem__((0, 2), -3),
    "ranks out of range": lambda f: f["ranks"].__setitem__((0, 0), 5),
    "scales of another shape": lambda f: f.update(scales=f["scales"][:, :1]),
    "caches of two shapes": lambda f: f.update(value_cache=f["value_cache"][:-1]),
    "seg_starts non-monotonic": lambda f: f["seg_starts"].__setitem__(1, 6),
}


@pytest.mark.parametrize("bad", list(UNUSED_BAD_TABLES))
@each_dtype
def test_a_call_without_adapter_rows_reads_no_table(dtype, bad, rng):
    """Every seg_slots entry -1 and no composition entry (a decode step of requests without
    adapters): y_out is y bit for bit, read from y, x and seg_slots alone, so a table no row
    uses is not checked; with a slot in one segment the same table fails the call."""
    feeds = no_adapter_feeds(rng, dtype)
    UNUSED_BAD_TABLES[bad](feeds)
    np.testing.assert_array_equal(session(0, dtype).run(None, feeds)[0], feeds["y"])
    feeds["seg_slots"][0] = 0
    with pytest.raises(Exception, match="LoraSGMV"):
        session(0, dtype).run(None, feeds)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: f.update(x=f["x"][:-1]), r"input 'x' dim 0 must be 9 \(T, the rows of y\)"),
        (lambda f: f.update(y=f["y"][..., None]), r"input 'y' must have rank 2, got shape"),
        (lambda f: f["seg_slots"].__setitem__(1, -2), r"seg_slots\[1\] = -2 must be in"),
    ],
    ids=["x rows", "y rank", "slot -2"],
)
@each_dtype
def test_a_call_without_adapter_rows_checks_x_y_and_the_slots(dtype, mutate, match, rng):
    feeds = no_adapter_feeds(rng, dtype)
    mutate(feeds)
    with pytest.raises(Exception, match=match):  # the op's own checks: no declared shapes
        make_session(0, shapeless=True, **ATTRS[dtype]).run(None, feeds)


def rank_zero_feeds(rng, dtype):
    """valid_feeds' rows and slots 0 and 1 in use, of rank 4 at layer 0 and rank 0 at layer 1
    (adapters without the module there, as PEFT's q_proj/v_proj ones are at o_proj)."""
    return make_case(rng, dtype, [3, 2, 4], [0, -1, 1], [4, 4], layer_ranks=[[4, 4], [0, 0]])


@pytest.mark.parametrize("bad", list(UNUSED_BAD_TABLES))
@each_dtype
def test_a_call_whose_adapters_have_rank_0_at_the_layer_reads_no_rows(dtype, bad, rng):
    """Slots in use, each of rank 0 at the node's layer: y_out is y bit for bit and no table
    but the ranks is read; at the layer where they have rank 4, the same table fails the call."""
    feeds = rank_zero_feeds(rng, dtype)
    UNUSED_BAD_TABLES[bad](feeds)
    np.testing.assert_array_equal(session(1, dtype).run(None, feeds)[0], feeds["y"])
    with pytest.raises(Exception, match="LoraSGMV"):
        session(0, dtype).run(None, feeds)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda f: f["ranks"].__setitem__((1, 1), 5), r"ranks\[1, 1\] = 5 must be"),
        (lambda f: f["ranks"].__setitem__((1, 1), -1), r"ranks\[1, 1\] = -1 must be"),
        (lambda f: f["seg_slots"].__setitem__(0, 2), r"seg_slots\[0\] = 2 must be in"),
        (
            lambda f: f.update(ranks=f["ranks"][:1], scales=f["scales"][:1]),
            r"attribute 'layer' = 1 must be < num_layers",
        ),
    ],
    ids=["rank over max_rank", "rank -1", "slot out of range", "no ranks for the layer"],
)
@each_dtype
def test_a_call_with_rank_0_slots_still_checks_their_ranks(dtype, mutate, match, rng):
    """A slot whose rank is not 0 (or not readable) at the layer gets the full checks."""
    feeds = rank_zero_feeds(rng, dtype)
    mutate(feeds)
    with pytest.raises(Exception, match=match):
        make_session(1, shapeless=True, **ATTRS[dtype]).run(None, feeds)


@each_dtype
def test_rank_over_the_limit(dtype, rng):
    feeds = make_case(rng, dtype, [2], [0], [513], in_f=8, out_f=8)
    run_expect_error(feeds, "rank over the limit 512", dtype)


@each_dtype
def test_layer_attribute_out_of_range(dtype, rng):
    match = r"attribute 'layer' = 3 must be < num_layers = 1"
    run_expect_error(valid_feeds(rng, dtype), match, dtype, layer=3)


@each_dtype
def test_negative_layer_attribute(dtype):
    with pytest.raises(Exception, match="attribute 'layer' must be >= 0, got -1"):
        make_session(-1, **ATTRS[dtype])


def composed_feeds(rng, dtype):
    """Segment 0: slot 0 (plain); 1: slots 0 + 1 composed; 2: base; 3: slot 2 (DoRA)."""
    return make_case(rng, dtype, [3, 2, 4, 2], [0, 0, -1, 2], [4, 4, 4],
                     comp=[(1, 1, 0.5)], dora_slots=[2])  # fmt: skip


def _set(name, index, value):
    return lambda f: f[name].__setitem__(index, value)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (_set("comp_weights", 0, np.nan), r"comp_weights\[0\] = nan is not finite"),
        (_set("comp_weights", 0, -np.inf), r"comp_weights\[0\] = -inf is not finite"),
        (_set("comp_segs", 0, 4), r"comp_segs\[0\] = 4 must be in \[0, 4\) \(S"),
        (_set("comp_slots", 0, -1), r"comp_slots\[0\] = -1 must be in \[0, 3\)"),
        (_set("comp_segs", 0, 3), r"segment 3 composes 2 adapters and slot 2 is DoRA"),
        (_set("seg_slots", 1, 2), r"segment 1 composes 2 adapters and slot 2 is DoRA"),
        (_set("dora_offsets", 2, -2), r"dora_offsets\[2\] = -2 must be -1 \(no DoRA row\)"),
        (
            lambda f: f["dora_offsets"].__setitem__(2, 2 * f["key_cache"].size - 5),
            r"dora_offsets\[2\] = \d+ is an out-of-range page",
        ),
        (
            lambda f: f.update(dora_offsets=f["dora_offsets"][:1]),
            r"input 'dora_offsets' dim 0 must be 3 \(num_slots, as a_offsets, or 0",
        ),
        (
            lambda f: f.update(comp_weights=f["comp_weights"][:0]),
            r"input 'comp_weights' dim 0 must be 1 \(E, as comp_segs\)",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
@each_dtype
def test_bad_composition_and_dora_inputs(dtype, mutate, match, rng):
    feeds = composed_feeds(rng, dtype)
    check(dict(feeds), dtype)  # valid as made
    mutate(feeds)
    run_expect_error(feeds, match, dtype)


def test_composition_inputs_go_together(rng):
    feeds = composed_feeds(rng, "float32")
    sess = make_session(0, optional=("comp_segs", "comp_slots", "dora_offsets"))
    feeds.pop("comp_weights")
    with pytest.raises(Exception, match="'comp_segs', 'comp_slots' and 'comp_weights' go together"):
        sess.run(None, feeds)


@each_dtype
def test_composed_rank_over_the_limit(dtype, rng):
    """Each adapter within the limit, their sum (300 + 300) over it: named."""
    feeds = make_case(rng, dtype, [2], [0], [300, 300], in_f=8, out_f=8, comp=[(0, 1, 1.0)])
    run_expect_error(feeds, r"segment 0 composes adapters of total rank 600 at layer 0, a rank "
                     "over the limit 512", dtype)  # fmt: skip


# ---- row_types errors ---------------------------------------------------------------------------


def mixed_feeds(rng, dtype):
    """Slot s of type TYPES[s] (rank 4, a DoRA row), each in a segment of its own (37 -> 53)."""
    return make_case(rng, dtype, [3, 4, 2, 2], [0, 1, 2, 3], [4] * 4, 37, 53,
                     dora_slots=[0, 1, 2, 3], slot_dtypes=TYPES)  # fmt: skip


@pytest.mark.parametrize("value", [0, 2, 5, 11, -1, 1 << 20])
@each_dtype
def test_bad_row_types_value(dtype, value, rng):
    feeds = mixed_feeds(rng, dtype)
    check(dict(feeds), dtype)  # valid as made
    feeds["row_types"][1] = value
    types = r"1 \(float32\), 16 \(bfloat16\), 10 \(float16\) or 3 \(int8\)"
    run_expect_error(feeds, rf"row_types\[1\] = {value} must be {types}", dtype)


@pytest.mark.parametrize("length", [1, 3, 5, 8])
@each_dtype
def test_row_types_of_another_length(dtype, length, rng):
    """row_types of neither num_slots (4) entries nor 0."""
    feeds = mixed_feeds(rng, dtype)
    feeds["row_types"] = np.resize(feeds["row_types"], length)
    with pytest.raises(Exception, match="row_types") as error:
        session_for(feeds, dtype).run(None, feeds)
    assert "num_slots" in str(error.value)


@pytest.mark.parametrize(
    "table,features", [("a_offsets", 37), ("b_offsets", 53), ("dora_offsets", 53)]
)
@pytest.mark.parametrize("slot", range(4))
@each_dtype
def test_row_types_row_overrunning_its_half(dtype, slot, table, features, rng):
    """Slot s's row (of type TYPES[s], whatever the attribute) one pool element too long for
    the room left in key_cache (A) or value_cache (B^T, D): the error counts the row in the
    slot's own type."""
    feeds = mixed_feeds(rng, dtype)
    half = feeds["key_cache"].size
    offset = (half if table == "a_offsets" else 2 * half) - row_elems(features, TYPES[slot]) + 1
    at = (slot,) if table == "dora_offsets" else (slot, 2)
    feeds[table][at] = offset
    with pytest.raises(ValueError, match="out-of-range page"):
        reference(feeds, dtype)
    name, unit = rf"{table}\[{', '.join(map(str, at))}\]", ROW_UNIT[TYPES[slot]]
    expected = rf"{name} = {offset} is an out-of-range page: a row of {features} {unit}"
    run_expect_error(feeds, expected, dtype)


@pytest.mark.parametrize("half_type", ["bfloat16", "float16"])
@each_dtype
def test_row_types_a_row_fits_its_slots_type_only(dtype, half_type, rng):
    """A 16-bit B^T row of 53 values (27 pool elements) ending value_cache is read; the same
    offset for a float32 slot's row (53 elements: past the end) names that slot's offset,
    whatever the attribute."""
    feeds = make_case(rng, dtype, [3, 4], [0, 1], [4, 4], 37, 53,
                      slot_dtypes=["float32", half_type])  # fmt: skip
    offset = 2 * feeds["key_cache"].size - row_elems(53, half_type)
    move_row(feeds, half_type, "b_offsets", 1, 3, 53, offset)
    check(feeds, dtype)
    feeds["b_offsets"][0, 2] = offset
    expected = rf"b_offsets\[0, 2\] = {offset} is an out-of-range page: a row of 53 elements"
    run_expect_error(feeds, expected, dtype)
