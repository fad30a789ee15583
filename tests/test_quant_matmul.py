"""QuantMatMul (domain ort_lora, CPU): a 4- or 8-bit block-quantized weight in column tiles times
a float input quantized to int8 per block, against numpy on the same numbers (quant.py), and
against ONNX Runtime's own com.microsoft.MatMulNBits on the same weights; bad inputs."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from rerun_with import assert_passes_with

import ort_lora
from ort_lora import quant_tiles
from ort_lora.export.quant import (
    pack_codes,
    quantize_activations,
    quantize_rtn,
    tile_blocks,
    untile_blocks,
)

INPUTS = ("x", "codes", "scales", "zeros", "offsets")
# float32 rounding of sums over K of products of the int8 x and the weight, in another order
RTOL, ATOL = 1e-4, 1e-4


def signature(feeds: dict) -> tuple[tuple[str, str], ...]:
    """The inputs fed and their types, as session() takes them."""
    return tuple((name, a.dtype.name) for name, a in feeds.items())


@functools.lru_cache(maxsize=64)
def session(inputs: tuple[tuple[str, str], ...], outputs: int = 1, **attrs):
    present = dict(inputs)
    node_inputs = [name if name in present else "" for name in INPUTS]
    while node_inputs[-1] == "":
        node_inputs.pop()
    dtypes = {"uint8": TensorProto.UINT8, "float16": TensorProto.FLOAT16}
    graph_inputs = [
        helper.make_tensor_value_info(n, dtypes.get(t, TensorProto.FLOAT), None) for n, t in inputs
    ]
    ys = ["y", "y1", "y2"][:outputs]
    node = helper.make_node("QuantMatMul", node_inputs, ys, domain=ort_lora.OPS_DOMAIN, **attrs)
    infos = [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ys]
    graph = helper.make_graph([node], "g", graph_inputs, infos)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    opts = ort_lora.session_options(intra_op_num_threads=2)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


# The block forms the op serves: integer zero points, none (the midpoint), zero points with
# float offsets, offsets without zero points, and a GGUF file's own Q4_0 and Q4_1 numbers
# (float16 scales and minimums: 4 bits tile them in float16, the default model's blocks)
KINDS = {
    "zeros": dict(zeros=True),
    "symmetric": dict(zeros=False),
    "offsets": dict(zeros=True, offsets=True),
    "float-offsets": dict(zeros=False, offsets=True),
    "gguf-q4_0": dict(zeros=False, gguf=True),
    "gguf-q4_1": dict(zeros=False, offsets=True, gguf=True),
}


def weights(rng, n, k, block, zeros=True, offsets=False, bits=4, gguf=False):
    """gguf: float16 scales d and minimums m as a GGUF file has them (offsets m + 8 d)."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    q = quantize_rtn(w, bits, block, symmetric=not zeros)
    if gguf:
        q = dataclasses.replace(q, scales=q.scales.astype(np.float16).astype(np.float32))
    if offsets:
        off = rng.standard_normal(q.scales.shape).astype(np.float32)
        if gguf:  # minimum + 8 d, rounded once to float32 (gguf_blocks.py's Q4_1 offsets)
            off = (off * 0.1).astype(np.float16).astype(np.float32) + np.float32(8) * q.scales
        q = dataclasses.replace(q, offsets=off)
    return q


def feeds_of(q, x):
    t = tile_blocks(q)
    feeds = {"x": x, "codes": t.codes, "scales": t.scales}
    if t.zeros is not None:
        feeds["zeros"] = t.zeros
    if t.offsets is not None:
        feeds["offsets"] = t.offsets
    return feeds


def run(q, x):
    n, k = q.shape
    feeds = feeds_of(q, x)
    attrs = dict(K=k, N=n, block_size=q.block_size, bits=q.bits)
    return session(signature(feeds), **attrs).run(None, feeds)[0]


def expected(q, x):
    """quant.py's semantics: int8 x per block times the dequantized weight without offsets,
    plus the float block sums of x times the offsets."""
    base = dataclasses.replace(q, offsets=None).dequantize().astype(np.float64)
    y = quantize_activations(x, q.block_size).astype(np.float64) @ base.T
    if q.offsets is not None:
        sums = x.reshape(*x.shape[:-1], -1, q.block_size).sum(-1).astype(np.float64)
        y += sums @ q.offsets.T.astype(np.float64)
    return y


SHAPES = [  # (rows, N, K, block): decode and prefill rows, N off the 64-column tiles, blocks
    (1, 16, 32, 32),
    (3, 40, 64, 32),
    (8, 192, 576, 32),
    (32, 960, 576, 32),
    (13, 100, 256, 64),
    (70, 33, 128, 16),
    (131, 48, 256, 128),
    (2, 200, 64, 32),  # 4 tiles, the last with one 16-column strip of 8 columns
    (11, 130, 96, 32),  # with the others, every row-group size of the kernels (1-8 rows)
    (5, 72, 64, 64),
    (15, 130, 96, 32),  # 4 bits on AVX-512: a group of 8 rows, then one of 7
    (12, 72, 64, 32),  # 8 + 4
]


@pytest.mark.parametrize("rows,n,k,block", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_shapes(rows, n, k, block, kind, bits, rng):
    q = weights(rng, n, k, block, **KINDS[kind], bits=bits)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :block] = 0.0  # a block of zeros: scale 0, codes 0
    y = run(q, x)
    assert y.shape == (rows, n)
    np.testing.assert_allclose(y, expected(q, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_float_inputs_at_accuracy_level_0(kind, bits, rng):
    """accuracy_level 0 (--verify's check): x as it is, times the dequantized weight."""
    q = weights(rng, 100, 128, 32, **KINDS[kind], bits=bits)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    feeds = feeds_of(q, x)
    attrs = dict(K=128, N=100, block_size=32, bits=bits, accuracy_level=0)
    y = session(signature(feeds), **attrs).run(None, feeds)[0]
    want = x.astype(np.float64) @ q.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    assert np.abs(run(q, x) - want).max() > 1e-3  # level 4 rounds x to int8: not the same


@pytest.mark.parametrize("bits", [4, 8])
def test_leading_dims(bits, rng):
    q = weights(rng, 24, 64, 32, bits=bits)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    y = run(q, x)
    assert y.shape == (2, 5, 24)
    np.testing.assert_allclose(y, expected(q, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("splits", [[64, 192], [128, 64, 24], [64, 64, 88]])
@pytest.mark.parametrize("bits", [4, 8])
def test_splits_cut_y_by_columns(splits, bits, rng):
    """With splits, output i is y's columns [sum(splits[:i]), sum(splits[:i + 1])): q/k/v's
    stacked product without a Split."""
    n, k, rows = sum(splits), 128, 11
    q = weights(rng, n, k, 32, offsets=True, bits=bits)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    feeds = feeds_of(q, x)
    attrs = dict(K=k, N=n, block_size=32, bits=bits, splits=tuple(splits))
    ys = session(signature(feeds), outputs=len(splits), **attrs).run(None, feeds)
    starts = np.cumsum([0, *splits])
    for y, a, b in zip(ys, starts[:-1], starts[1:], strict=True):
        assert y.shape == (rows, b - a)
        np.testing.assert_allclose(y, expected(q, x)[:, a:b], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_tiles_read_back(bits, kind, rng):
    """The readers of an export's tiles (quant_reference.py, adapters/base_weights.py) get the
    blocks back: untile_blocks inverts tile_blocks, quant_tiles.dequantize is W (N = 100: the
    last tile padded)."""
    q = weights(rng, 100, 96, 32, **KINDS[kind], bits=bits)
    t = tile_blocks(q)
    assert t.bits == bits and t.block_size == 32
    back = untile_blocks(t, 100)
    for field in ("codes", "scales", "zeros", "offsets"):
        want, got = getattr(q, field), getattr(back, field)
        assert (want is None and got is None) or np.array_equal(want, got), field
    np.testing.assert_allclose(quant_tiles.dequantize(t, 100), q.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [200, 1100])
@pytest.mark.parametrize("rows", [1, 3, 32, 70])
@pytest.mark.parametrize("offsets", [False, True], ids=["q4_0", "q4_1"])
def test_float16_tiles_give_the_same_y(offsets, rows, n, rng):
    """A GGUF file's numbers tile in float16 (scales, and minimums for the offsets), and y is
    bit for bit what the float32 tiles of the same weights give (offset = m + 8 d rounded once
    in both), whether the kernels read them as they are (few rows) or as each work item widens
    them for its row groups (more rows; 1100 columns: work items of several tiles)."""
    q = weights(rng, n, 96, 32, zeros=False, offsets=offsets, gguf=True)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    feeds = feeds_of(q, x)
    assert feeds["scales"].dtype == np.float16
    assert offsets == ("offsets" in feeds)
    assert feeds.get("offsets", feeds["scales"]).dtype == np.float16
    wide = dict(feeds, scales=feeds["scales"].astype(np.float32))
    if offsets:
        wide["offsets"] = feeds["offsets"].astype(np.float32) + np.float32(8) * wide["scales"]
    attrs = dict(K=96, N=n, block_size=32, bits=4)
    for level in (0, 4):  # float x, then int8 x
        half, full = (
            session(signature(f), accuracy_level=level, **attrs).run(None, f)[0]
            for f in (feeds, wide)
        )
        assert np.array_equal(half, full), level
    np.testing.assert_allclose(half, expected(q, x), rtol=RTOL, atol=ATOL)


def test_float16_only_where_exact(rng):
    """Scales or offsets float16 cannot give exactly stay float32 (rtn's scales, a minimum
    that is not a float16, zero points, 8 bits)."""
    q = weights(rng, 64, 64, 32, zeros=False, offsets=True, gguf=True)
    assert tile_blocks(q).scales.dtype == np.float16
    off = q.offsets.copy()
    off[3, 1] += np.float32(1e-3)  # no float16 minimum gives it
    for other in (
        dataclasses.replace(q, offsets=off),
        weights(rng, 64, 64, 32, zeros=False),
        weights(rng, 64, 64, 32, zeros=True, gguf=True),
        weights(rng, 64, 64, 32, zeros=False, gguf=True, bits=8),
    ):
        t = tile_blocks(other)
        assert t.scales.dtype == np.float32
        assert t.offsets is None or t.offsets.dtype == np.float32


def test_empty_rows(rng):
    q = weights(rng, 24, 64, 32)
    assert run(q, np.zeros((0, 64), np.float32)).shape == (0, 24)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
def test_extreme_codes(bits, zeros, block, rng):
    """The lowest and highest codes against x of +-127 after quantization: AVX2's int16 pair
    sums stay exact (8 bits: code - 128 = -128 times 127, twice, is the largest pair), and so
    do the 4-bit kernels' int16 sums over up to 32 k of a block, of one row and of row groups
    (rows of x all 127 against columns of the top code, the largest sums; a block of 128 is
    widened in parts)."""
    n, k, top = 40, 256, 2**bits - 1
    q = weights(rng, n, k, block, zeros=zeros, bits=bits)
    codes = np.where(rng.random((n, k)) < 0.5, 0, top).astype(np.uint8)
    codes[:20] = top
    q = dataclasses.replace(q, codes=pack_codes(codes, bits, block))
    x = np.where(rng.random((9, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[[0, 1, 2, 8]] = 1.0  # in the first row group of every kernel, and the last row alone
    np.testing.assert_allclose(run(q, x), expected(q, x), rtol=RTOL, atol=ATOL)


def matmulnbits(q, x):
    """ONNX Runtime's MatMulNBits at accuracy_level 4 on q (initializers: MLAS quantizes x to
    int8 only for weights it prepacked)."""
    n, k = q.shape
    inits = [numpy_helper.from_array(q.codes, "B"), numpy_helper.from_array(q.scales, "scales")]
    if q.zeros is not None:
        inits.append(numpy_helper.from_array(q.packed_zero_points(), "zero_points"))
    attrs = dict(K=k, N=n, bits=q.bits, block_size=q.block_size, accuracy_level=4)
    node = helper.make_node("MatMulNBits", ["x", *(i.name for i in inits)], ["y"], **attrs)
    node.domain = "com.microsoft"
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", [x_info], [y_info], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets).SerializeToString()
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_matmulnbits(zeros, bits, rng):
    """The same weights and input through ONNX Runtime's MatMulNBits at accuracy_level 4 (the
    op QuantMatMul stands in for): equal to float32 rounding, and both away from the float
    product by the int8 input's rounding."""
    q = weights(rng, 96, 576, 32, zeros=zeros, bits=bits)
    x = rng.standard_normal((32, 576)).astype(np.float32)
    theirs, ours = matmulnbits(q, x), run(q, x)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=1e-4)
    unquantized = x @ q.dequantize().T
    assert np.abs(theirs - unquantized).max() > 1e-3  # MLAS took its int8 path


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_narrower_isa_kernels(isa):
    """The AVX2 and baseline kernels (forced with ORT_LORA_QUANT_ISA) pass the value tests."""
    cases = "shapes or leading_dims or extreme_codes or matches or splits or float16_tiles"
    assert_passes_with(__file__, cases, "ORT_LORA_QUANT_ISA", isa)


# ---- bad input: an error naming it ---------------------------------------------------------


def bad_run(feeds, match, **attrs):
    q_attrs = dict(K=64, N=100, block_size=32, bits=4) | attrs
    with pytest.raises(Exception, match=match):
        session(signature(feeds), **q_attrs).run(None, feeds)


def valid(rng):
    return feeds_of(weights(rng, 100, 64, 32), rng.standard_normal((3, 64)).astype(np.float32))


@pytest.mark.parametrize(
    "name,change,match",
    [
        ("x", lambda a: a[:, :32], r"input 'x' must have last dim K = 64"),
        ("codes", lambda a: a[:1], r"input 'codes' must have shape \[2, 2, 4, 256\]"),
        ("scales", lambda a: a[..., :8], r"input 'scales' must have shape \[2, 2, 64\]"),
        ("zeros", lambda a: a[:, :1], r"input 'zeros' must have shape \[2, 2, 64\]"),
        ("offsets", lambda a: a[:, :1], r"input 'offsets' must have shape \[2, 2, 64\]"),
    ],
    ids=["x_k", "codes", "scales", "zeros", "offsets"],
)
def test_bad_inputs(name, change, match, rng):
    feeds = valid(rng)
    feeds["offsets"] = np.zeros_like(feeds["scales"])
    feeds[name] = np.ascontiguousarray(change(feeds[name]))
    bad_run(feeds, match)


HALF_RULE = r"float16 'scales' need bits 4 and no 'zeros' input"


@pytest.mark.parametrize(
    "change,match,attrs",
    [
        (dict(scales=np.float16), HALF_RULE, dict(bits=8)),
        (dict(scales=np.float16, zeros=np.uint8), HALF_RULE, {}),
        (dict(offsets=np.float16), "input 'offsets' must be float32, got float16", {}),
        (dict(scales=np.float16), "input 'offsets' must be float16, got float32", {}),
        (dict(scales=np.float64), r"Unexpected input data type. Actual: \(tensor\(double\)\)", {}),
    ],
    ids=["bits8", "zeros", "offsets16", "offsets32", "scales64"],
)
def test_bad_scale_types(change, match, attrs, rng):
    """Scales and offsets are float32, or both float16 with 4 bits and no zero points."""
    feeds = valid(rng)
    zeros = feeds.pop("zeros")
    feeds["offsets"] = np.zeros_like(feeds["scales"])
    if attrs.get("bits") == 8:
        feeds["codes"] = np.zeros((2, 2, 8, 256), np.uint8)
    for name, dtype in change.items():
        feeds[name] = (zeros if name == "zeros" else feeds[name]).astype(dtype)
    bad_run(feeds, match, **attrs)


@pytest.mark.parametrize(
    "attrs,match",
    [
        (dict(bits=5), "attribute 'bits' must be 4 or 8, got 5"),
        (dict(bits=8), r"input 'codes' must have shape \[2, 2, 8, 256\]"),
        (dict(block_size=24), "attribute 'block_size' must be a power of two >= 16, got 24"),
        (dict(K=48), r"attribute 'K' \(48\) must be a positive multiple of block_size \(32\)"),
        (dict(N=0), "attribute 'N' must be positive, got 0"),
        (dict(accuracy_level=2), "attribute 'accuracy_level' must be 4 .* or 0 / 1"),
        (dict(splits=(64, 30)), r"attribute 'splits' \[64, 30\] must sum to N \(100\)"),
        (dict(splits=(50, 50)), r"all but the last multiples of 64"),
        (dict(splits=(64, 0, 36)), r"each value must be positive"),
        (dict(splits=(64, 36)), r"the node has 1 outputs; attribute 'splits' names 2"),
    ],
    ids=[
        "bits",
        "bits_codes",
        "block",
        "K",
        "N",
        "level",
        "splits",
        "splits_tiles",
        "splits_zero",
        "outputs",
    ],  # fmt: skip
)
def test_bad_attributes(attrs, match, rng):
    bad_run(valid(rng), match, **attrs)
