"""Shared pieces of the PagedAttention tests: random paged cases, one-node models run with the
ort_lora ops (caches bound in place), and the comparison with the numpy reference."""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort
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
