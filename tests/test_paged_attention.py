"""PagedAttention (domain ort_lora, CPU float32) against its numpy reference, and the reference
against a dense causal attention on an unpaged layout."""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ort_lora
from ort_lora.ops.paged_attention_ref import paged_attention

RTOL = ATOL = 1e-5  # float32 kernel vs float64 reference
INPUTS = (
    "query",
    "key",
    "value",
    "key_cache",
    "value_cache",
    "cumulative_sequence_length",
    "past_seqlens",
    "block_table",
    "cos_cache",
    "sin_cache",
    "slot_mapping",
)
INT_INPUTS = {"cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping"}


# ---- building cases --------------------------------------------------------------------------


def rotary_tables(max_pos, half, base=10000.0):
    """cos, sin [max_pos, half] of the usual RoPE frequencies."""
    inv_freq = base ** (-np.arange(half) / half)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]  # [max_pos, half]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def make_case(
    rng,
    seqs,
    num_heads=4,
    kv_heads=2,
    head_size=64,
    block_size=16,
    rotary_half=None,
    slot_mapping=False,
):
    """Inputs of one call. seqs = [(past, new), ...]; random non-contiguous block tables, every
    cache slot filled with random data; rotary_half: cos/sin width (None = no rotary)."""
    lengths = [p + n for p, n in seqs]
    needed = [-(-length // block_size) for length in lengths]
    num_blocks = sum(needed) + 3
    perm = rng.permutation(num_blocks)
    width = max(needed + [0]) + 1
    block_table = np.full((len(seqs), width), -1, np.int32)
    start = 0
    for b, count in enumerate(needed):
        block_table[b, :count] = perm[start : start + count]
        start += count
    num_tokens = sum(n for _, n in seqs)
    kv_hidden = kv_heads * head_size
    cache_shape = (num_blocks, block_size, kv_heads, head_size)
    inputs = {
        "query": rng.standard_normal((num_tokens, num_heads * head_size), np.float32),
        "key": rng.standard_normal((num_tokens, kv_hidden), np.float32),
        "value": rng.standard_normal((num_tokens, kv_hidden), np.float32),
        "key_cache": rng.standard_normal(cache_shape, np.float32),
        "value_cache": rng.standard_normal(cache_shape, np.float32),
        "cumulative_sequence_length": np.cumsum([0] + [n for _, n in seqs]).astype(np.int32),
        "past_seqlens": np.array([p for p, _ in seqs], np.int32),
        "block_table": block_table,
    }
    if rotary_half is not None:
        max_pos = max(lengths + [1]) + int(rng.integers(0, 5))
        inputs["cos_cache"], inputs["sin_cache"] = rotary_tables(max_pos, rotary_half)
    if slot_mapping:
        inputs["slot_mapping"] = derived_slots(inputs, block_size)
        inputs["slot_mapping"][rng.random(num_tokens) < 0.25] = -1
    return inputs


def derived_slots(inputs, block_size):
    """The slot each new token gets from its block table: [T] int32."""
    slots = []
    cu, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    for b in range(len(past)):
        pos = past[b] + np.arange(cu[b + 1] - cu[b])
        slots.append(inputs["block_table"][b][pos // block_size] * block_size + pos % block_size)
    return np.concatenate(slots + [np.zeros(0, np.int32)]).astype(np.int32)


@functools.lru_cache(maxsize=64)
def session(present, outputs=1, dtypes=(), **attrs):
    """A one-node model over the inputs named in `present`, run with the ort_lora ops.
    dtypes: (input name, onnx dtype) overrides."""
    overrides = dict(dtypes)
    graph_inputs, node_inputs = [], []
    for name in INPUTS:
        if name not in present:
            node_inputs.append("")
            continue
        dtype = overrides.get(name, TensorProto.INT32 if name in INT_INPUTS else TensorProto.FLOAT)
        graph_inputs.append(helper.make_tensor_value_info(name, dtype, None))
        node_inputs.append(name)
    while node_inputs[-1] == "":
        node_inputs.pop()
    out_names = ["output", "key_cache_out", "value_cache_out"][:outputs]
    node = helper.make_node(
        "PagedAttention", node_inputs, out_names, domain=ort_lora.OPS_DOMAIN, **attrs
    )
    graph = helper.make_graph(
        [node],
        "paged_attention",
        graph_inputs,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in out_names],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)],
    )
    opts = ort_lora.session_options(intra_op_num_threads=2)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run_kernel(inputs, **attrs):
    """Runs the op with the caches bound in place (IOBinding); returns the output. The
    caches in `inputs` are updated by the run."""
    sess = session(tuple(sorted(inputs)), **attrs)
    io = sess.io_binding()
    for name, arr in inputs.items():
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
    io.bind_output("output", "cpu")
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def check_against_reference(inputs, **attrs):
    """Kernel output and cache contents after the run equal the reference's."""
    expected, key_after, value_after = paged_attention(**inputs, **attrs)
    got = run_kernel(inputs, **attrs)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    # Rotated keys: float32 kernel vs float64 reference, so not bit-equal.
    np.testing.assert_allclose(inputs["key_cache"], key_after, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(inputs["value_cache"], value_after)


# ---- kernel vs reference ---------------------------------------------------------------------

MIXED = [(0, 37), (50, 1), (17, 5), (130, 1), (0, 1), (33, 16)]  # prefill chunks + decode


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (16, 2)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("rotary", ["none", "half", "interleaved"])
def test_mixed_batch(heads, head_size, rotary):
    rng = np.random.default_rng()
    num_heads, kv_heads = heads
    rotary_half = None if rotary == "none" else head_size // 2
    inputs = make_case(rng, MIXED, num_heads, kv_heads, head_size, rotary_half=rotary_half)
    check_against_reference(
        inputs,
        num_heads=num_heads,
        kv_num_heads=kv_heads,
        do_rotary=int(rotary != "none"),
        rotary_interleaved=int(rotary == "interleaved"),
    )


VARIANTS = {
    "window": dict(local_window_size=7),
    "window0": dict(local_window_size=0),
    "window_long": dict(local_window_size=40),
    "softcap": dict(softcap=1.5),
    "scale": dict(scale=0.3),
    "all": dict(local_window_size=9, softcap=2.0, scale=0.2, do_rotary=1, rotary_interleaved=1),
    "partial_rotary": dict(do_rotary=1, rotary_half=12),
    "partial_rotary_interleaved": dict(do_rotary=1, rotary_interleaved=1, rotary_half=10),
    "slot_mapping": dict(slot_mapping=True),
    "block_size_5": dict(block_size=5, local_window_size=11, do_rotary=1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants(variant):
    rng = np.random.default_rng()
    attrs = dict(VARIANTS[variant])
    case = {k: attrs.pop(k) for k in ("rotary_half", "slot_mapping", "block_size") if k in attrs}
    if attrs.get("do_rotary"):
        case.setdefault("rotary_half", 32)
    inputs = make_case(rng, MIXED, 6, 2, 64, **case)
    check_against_reference(inputs, num_heads=6, kv_num_heads=2, **attrs)


SIZES = {
    "empty_batch": [],
    "no_new_tokens": [(5, 0), (0, 0)],
    "one_decode": [(40, 1)],
    "one_first_token": [(0, 1)],
    "long_prefill": [(0, 1100)],
    "long_prefill_chunk": [(700, 300), (12, 1)],
    "long_decode_split": [(3000, 1)],
    "split_with_tokens": [(900, 20)],
}


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("window", [-1, 100])
def test_sizes(size, window):
    rng = np.random.default_rng()
    inputs = make_case(rng, SIZES[size], 8, 1, 64, rotary_half=32)
    check_against_reference(
        inputs, num_heads=8, kv_num_heads=1, do_rotary=1, local_window_size=window
    )


def test_slot_mapping_elsewhere():
    """slot_mapping decides where K/V go, even outside the block table (here: spare blocks)."""
    rng = np.random.default_rng()
    inputs = make_case(rng, [(20, 3), (0, 4)], 4, 2, 64, block_size=4)
    used = set(inputs["block_table"][inputs["block_table"] >= 0].tolist())
    spare = [b for b in range(inputs["key_cache"].shape[0]) if b not in used]
    slots = np.array([spare[0] * 4 + i for i in range(4)] + [spare[1] * 4 + i for i in range(3)])
    inputs["slot_mapping"] = rng.permutation(slots).astype(np.int32)
    check_against_reference(inputs, num_heads=4, kv_num_heads=2)
