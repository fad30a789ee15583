"""PagedAttention (domain ort_lora, CPU float32) against its numpy reference, and the reference
against a dense causal attention on an unpaged layout."""

from __future__ import annotations

import functools
import re

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
    "block_size_32": dict(block_size=32, do_rotary=1, rotary_interleaved=1),
    "head_size_40": dict(head_size=40, do_rotary=1, rotary_half=20),  # not a multiple of 16
    "head_size_72": dict(head_size=72, block_size=32, local_window_size=20),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants(variant):
    rng = np.random.default_rng()
    attrs = dict(VARIANTS[variant])
    case_keys = ("rotary_half", "slot_mapping", "block_size", "head_size")
    case = {"head_size": 64} | {k: attrs.pop(k) for k in case_keys if k in attrs}
    if attrs.get("do_rotary"):
        case.setdefault("rotary_half", 32)
    inputs = make_case(rng, MIXED, 6, 2, **case)
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


def test_slot_mapping_needs_no_blocks_for_new_tokens():
    """With slot_mapping, the new tokens' block_table entries are never read (may be -1)."""
    rng = np.random.default_rng()
    inputs = make_case(rng, [(8, 9), (0, 3)], 4, 2, 64, block_size=4, slot_mapping=True)
    inputs["block_table"][0, 2:] = -1  # positions 8.. are new
    inputs["block_table"][1, :] = -1
    check_against_reference(inputs, num_heads=4, kv_num_heads=2)


# ---- the reference against an independent dense oracle --------------------------------------


def dense_rope(x, half, base, interleaved):
    """RoPE of x [L, heads, D] at positions 0..L-1, written independently of the reference:
    HF rotate_half for halves, complex multiplication for interleaved pairs."""
    angles = np.arange(x.shape[0])[:, None] * base ** (-np.arange(half) / half)  # [L, half]
    out = x.copy()
    if interleaved:
        z = (x[..., 0 : 2 * half : 2] + 1j * x[..., 1 : 2 * half : 2]) * np.exp(1j * angles)[
            :, None
        ]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = z.real, z.imag
    else:
        cos = np.cos(np.concatenate([angles, angles], -1))[:, None]  # [L, 1, 2 * half]
        sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
        rot = x[..., : 2 * half]
        rotate_half = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
        out[..., : 2 * half] = rot * cos + rotate_half * sin
    return out


def dense_attention(q, k, v, scale, window, softcap):
    """Causal attention of L tokens over themselves: q [L, H, D], k, v [L, KVH, D]."""
    length, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    mask = np.tril(np.ones((length, length), bool))
    if window >= 0:
        mask &= np.triu(np.ones((length, length), bool), -window)
    out = np.empty_like(q)
    for h in range(num_heads):
        scores = q[:, h] @ k[:, h // group].T * scale  # [L, L]
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        scores[~mask] = -np.inf
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (weights / weights.sum(-1, keepdims=True)) @ v[:, h // group]
    return out


def scatter(cache, table, block_size, start, rows):
    """Writes rows [n, KVH, D] at positions start.. of the sequence with block table `table`."""
    for i, row in enumerate(rows):
        cache[table[(start + i) // block_size], (start + i) % block_size] = row


@pytest.mark.parametrize(
    "attrs",
    [
        dict(),
        dict(do_rotary=1),
        dict(do_rotary=1, rotary_interleaved=1, local_window_size=5),
        dict(softcap=1.0, scale=0.25, local_window_size=0),
    ],
    ids=["plain", "rope", "rope_interleaved_window", "softcap_scale_window0"],
)
def test_reference_matches_dense_attention(attrs):
    """Whole sequences attend densely; the same sequences split into a paged past (rotated
    keys in the cache) and new tokens must give the reference the same last rows."""
    rng = np.random.default_rng()
    num_heads, kv_heads, head_size, half, block_size = 6, 2, 32, 12, 4
    seqs = [(13, 6), (0, 5), (22, 1)]
    inputs = make_case(rng, seqs, num_heads, kv_heads, head_size, block_size, rotary_half=half)
    if not attrs.get("do_rotary"):
        del inputs["cos_cache"], inputs["sin_cache"]
    scale = attrs.get("scale") or head_size**-0.5
    window, softcap = attrs.get("local_window_size", -1), attrs.get("softcap", 0)
    expected, new_kv = [], []
    cu = inputs["cumulative_sequence_length"]
    for b, (past, new) in enumerate(seqs):
        q = rng.standard_normal((past + new, num_heads, head_size))  # [L, H, D]
        k = rng.standard_normal((past + new, kv_heads, head_size))  # [L, KVH, D]
        v = rng.standard_normal((past + new, kv_heads, head_size))
        inputs["query"][cu[b] : cu[b + 1]] = q[past:].reshape(new, -1)
        inputs["key"][cu[b] : cu[b + 1]] = k[past:].reshape(new, -1)
        inputs["value"][cu[b] : cu[b + 1]] = v[past:].reshape(new, -1)
        if attrs.get("do_rotary"):
            interleaved = attrs.get("rotary_interleaved", 0)
            q, k = (dense_rope(x, half, 10000.0, interleaved) for x in (q, k))
        expected.append(dense_attention(q, k, v, scale, window, softcap)[past:])
        table = inputs["block_table"][b]
        scatter(inputs["key_cache"], table, block_size, 0, k[:past])
        scatter(inputs["value_cache"], table, block_size, 0, v[:past])
        new_kv.append((table, past, k[past:], v[past:]))
    key_cache, value_cache = inputs["key_cache"].copy(), inputs["value_cache"].copy()
    for table, past, k_new, v_new in new_kv:
        scatter(key_cache, table, block_size, past, k_new)
        scatter(value_cache, table, block_size, past, v_new)
    out, key_after, value_after = paged_attention(
        **inputs, num_heads=num_heads, kv_num_heads=kv_heads, **attrs
    )
    np.testing.assert_allclose(out, np.concatenate(expected).reshape(out.shape), 1e-5, 1e-6)
    np.testing.assert_allclose(key_after, key_cache, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(value_after, value_cache)


# ---- acceptance: a pool bound through IOBinding is written in place and read back -----------


def bind_pool_run(sess, inputs, key_view, value_view):
    """Runs with the caches bound by pointer to the caller's pool views (no copy)."""
    io = sess.io_binding()
    for name, view in (("key_cache", key_view), ("value_cache", value_view)):
        assert view.flags.c_contiguous  # else ORT would copy and the writes would be lost
        io.bind_input(name, "cpu", 0, np.float32, list(view.shape), view.ctypes.data)
    for name, arr in inputs.items():
        io.bind_cpu_input(name, arr)
    io.bind_output("output", "cpu")
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[0]


def test_iobinding_pool_written_in_place_and_read_by_next_step():
    rng = np.random.default_rng()
    num_heads, kv_heads, head_size, block_size = 8, 2, 64, 8
    attrs = dict(num_heads=num_heads, kv_num_heads=kv_heads, do_rotary=1)
    prompt = make_case(rng, [(0, 21), (0, 9)], num_heads, kv_heads, head_size, block_size, 32)
    num_blocks = prompt["key_cache"].shape[0]
    pool = rng.standard_normal((2, num_blocks, block_size, kv_heads, head_size), np.float32)
    step1 = {n: a for n, a in prompt.items() if n not in ("key_cache", "value_cache")}
    step1["cos_cache"], step1["sin_cache"] = rotary_tables(64, 32)  # room for the decode step
    sess = session(tuple(sorted(prompt)), **attrs)
    _, key_after, value_after = paged_attention(
        **step1, key_cache=pool[0], value_cache=pool[1], **attrs
    )
    bind_pool_run(sess, step1, pool[0], pool[1])
    np.testing.assert_allclose(pool[0], key_after, rtol=1e-6, atol=1e-6)  # visible, no copy
    np.testing.assert_array_equal(pool[1], value_after)

    # Decode one token per sequence over the pool the first run wrote.
    step2 = dict(step1)
    step2["cumulative_sequence_length"] = np.array([0, 1, 2], np.int32)
    step2["past_seqlens"] = np.array([21, 9], np.int32)
    for name, width in (("query", num_heads), ("key", kv_heads), ("value", kv_heads)):
        step2[name] = rng.standard_normal((2, width * head_size), np.float32)
    got = bind_pool_run(sess, step2, pool[0], pool[1])

    # Oracle: both sequences from scratch (no past), all 22 / 10 tokens new.
    full = dict(step1, cumulative_sequence_length=np.array([0, 22, 32], np.int32))
    full["past_seqlens"] = np.zeros(2, np.int32)
    for name in ("query", "key", "value"):
        old, new = step1[name], step2[name]
        full[name] = np.concatenate([old[:21], new[:1], old[21:], new[1:]])
    expected, _, _ = paged_attention(**full, key_cache=pool[0], value_cache=pool[1], **attrs)
    np.testing.assert_allclose(got, expected[[21, 31]], rtol=RTOL, atol=ATOL)


# ---- validation: every bad input gets an error naming it -------------------------------------

NB = "NUM_BLOCKS"  # placeholder in messages, replaced by the case's num_blocks


def _set(name, fn):
    def mutate(x):
        x[name] = fn(x[name])

    return mutate


def _drop(*names):
    def mutate(x):
        for n in names:
            del x[n]

    return mutate


def _item(name, index, value):
    def mutate(x):
        x[name] = x[name].copy()
        x[name][index] = value if value != NB else x["key_cache"].shape[0]

    return mutate


def _i32(values):
    return lambda _: np.array(values, np.int32)


# Base case: seqs [(10, 3), (0, 2)], H=4, KVH=2, D=64, block_size=4, rotary half 16, T=5.
BAD_INPUTS = {
    "query_rank": (_set("query", lambda a: a.reshape(5, 4, 64)), "input 'query' must have rank 2"),
    "query_heads": (
        _set("query", lambda a: a[:, :-1].copy()),
        "input 'query' dim 1 must be num_heads (4) * head_size",
    ),
    "key_rows": (_set("key", lambda a: a[:-1].copy()), "input 'key' dim 0 must be 5"),
    "key_width": (
        _set("key", lambda a: a[:, :-64].copy()),
        "input 'key' dim 1 must be 128 (kv_num_heads * head_size)",
    ),
    "value_width": (_set("value", lambda a: a[:, :-1].copy()), "input 'value' dim 1 must be 128"),
    "value_rows": (_set("value", lambda a: a[:-2].copy()), "input 'value' dim 0 must be 5"),
    "cache_rank": (
        _set("key_cache", lambda a: a.reshape(a.shape[0], 4, 128)),
        "input 'key_cache' must have rank 4",
    ),
    "cache_kv_heads": (
        _set("key_cache", lambda a: a.reshape(a.shape[0], 4, 1, 128)),
        "input 'key_cache' dim 2 must be 2 (kv_num_heads)",
    ),
    "cache_head_size": (
        _set("key_cache", lambda a: a.reshape(a.shape[0], 8, 2, 32)),
        "input 'key_cache' dim 3 must be 64 (head_size)",
    ),
    "value_cache_shape": (
        _set("value_cache", lambda a: a[:-1].copy()),
        "input 'value_cache' must have the shape of 'key_cache'",
    ),
    "cu_length": (
        _set("cumulative_sequence_length", lambda a: a[:-1].copy()),
        "input 'cumulative_sequence_length' dim 0 must be 3",
    ),
    "block_table_rows": (
        _set("block_table", lambda a: a[:1].copy()),
        "input 'block_table' dim 0 must be 2 (batch_size)",
    ),
    "cu_start": (
        _set("cumulative_sequence_length", _i32([1, 3, 5])),
        "input 'cumulative_sequence_length' must start at 0, got 1",
    ),
    "cu_non_monotonic": (
        _set("cumulative_sequence_length", _i32([0, 6, 5])),
        "input 'cumulative_sequence_length' is non-monotonic: element 2 (5) < element 1 (6)",
    ),
    "cu_last": (
        _set("cumulative_sequence_length", _i32([0, 3, 4])),
        "input 'cumulative_sequence_length' must end at num_tokens (5",
    ),
    "past_negative": (
        _set("past_seqlens", _i32([10, -1])),
        "input 'past_seqlens' element 1 is -1; expected >= 0",
    ),
    "block_table_narrow": (
        _set("block_table", lambda a: a[:, :2].copy()),
        "input 'block_table' has 2 columns; sequence 0 needs 4 blocks",
    ),
    "block_id_high": (
        _item("block_table", (0, 1), NB),
        f"input 'block_table' [0, 1] = {NB} is out of range [0, {NB})",
    ),
    "block_id_unmapped": (
        _item("block_table", (0, 2), -1),
        f"input 'block_table' [0, 2] = -1 is out of range [0, {NB})",
    ),
    "block_id_new_tokens": (  # without slot_mapping the write needs the new tokens' blocks
        lambda x: (_drop("slot_mapping")(x), _item("block_table", (1, 0), -1)(x)),
        f"input 'block_table' [1, 0] = -1 is out of range [0, {NB})",
    ),
    "slot_mapping_length": (
        _set("slot_mapping", lambda a: a[:-1].copy()),
        "input 'slot_mapping' dim 0 must be 5",
    ),
    "slot_high": (
        lambda x: _item("slot_mapping", 2, x["key_cache"].shape[0] * 4)(x),
        "input 'slot_mapping' element 2 = ",
    ),
    "slot_below_minus_one": (
        _item("slot_mapping", 0, -2),
        "input 'slot_mapping' element 0 = -2 is out of range [-1, ",
    ),
    "no_cos": (_drop("cos_cache", "sin_cache"), "input 'cos_cache' is required"),
    "no_sin": (_drop("sin_cache"), "input 'sin_cache' is required"),
    "cos_too_wide": (
        lambda x: x.update(zip(("cos_cache", "sin_cache"), rotary_tables(20, 33))),
        "input 'cos_cache' dim 1 (rotary_dim / 2) must be in [1, head_size / 2 = 32]",
    ),
    "sin_shape": (
        _set("sin_cache", lambda a: a[:-1].copy()),
        "input 'sin_cache' must have the shape of 'cos_cache'",
    ),
    "cos_too_short": (
        lambda x: x.update(zip(("cos_cache", "sin_cache"), rotary_tables(12, 16))),
        "input 'cos_cache' has 12 rows (positions); sequence 0 needs positions up to 12",
    ),
}


def bad_case(rng):
    return make_case(rng, [(10, 3), (0, 2)], 4, 2, 64, 4, rotary_half=16, slot_mapping=True)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named(case):
    rng = np.random.default_rng()
    inputs = bad_case(rng)
    mutate, message = BAD_INPUTS[case]
    mutate(inputs)
    message = message.replace(NB, str(inputs["key_cache"].shape[0]))
    with pytest.raises(Exception, match=re.escape(message)):
        run_kernel(inputs, num_heads=4, kv_num_heads=2, do_rotary=1)


@pytest.mark.parametrize(
    "attrs, message",
    [
        (dict(num_heads=3, kv_num_heads=2), "num_heads (3) must be a positive multiple of kv_"),
        (dict(kv_num_heads=2), "attribute 'num_heads' (int) is required"),
        (dict(num_heads=4), "attribute 'kv_num_heads' (int) is required"),
        (
            dict(num_heads=4, kv_num_heads=2, local_window_size=-2),
            "attribute 'local_window_size' must be -1 (unused) or >= 0",
        ),
        (
            dict(num_heads=4, kv_num_heads=2, softcap=-1.0),
            "attribute 'softcap' must be >= 0 (0 = off), got -1",
        ),
        (
            dict(num_heads=4, kv_num_heads=2, do_rotary=2),
            "attribute 'do_rotary' must be 0 or 1, got 2",
        ),
        (dict(num_heads=4, kv_num_heads=2, scale=float("nan")), "attribute 'scale' must be finite"),
    ],
)
def test_bad_attribute_is_named(attrs, message):
    with pytest.raises(Exception, match=re.escape(message)):
        session(tuple(sorted(bad_case(np.random.default_rng()))), **attrs)


def test_cache_outputs_are_refused():
    inputs = bad_case(np.random.default_rng())
    sess = session(tuple(sorted(inputs)), outputs=3, num_heads=4, kv_num_heads=2, do_rotary=1)
    with pytest.raises(Exception, match="outputs 'key_cache_out' and 'value_cache_out' are not"):
        sess.run(None, inputs)


@pytest.mark.parametrize(
    "name, dtype, onnx_dtype",
    [
        ("query", np.float16, TensorProto.FLOAT16),
        ("key_cache", np.float64, TensorProto.DOUBLE),
        ("cumulative_sequence_length", np.int64, TensorProto.INT64),
        ("slot_mapping", np.int64, TensorProto.INT64),
    ],
)
def test_bad_dtype_is_named(name, dtype, onnx_dtype):
    """ORT checks element types against the op's declared types when the model loads."""
    inputs = bad_case(np.random.default_rng())
    with pytest.raises(Exception, match=rf"Type 'tensor\(\w+\)' of input parameter \({name}\)"):
        sess = session(
            tuple(sorted(inputs)), dtypes=((name, onnx_dtype),), num_heads=4, kv_num_heads=2
        )
        sess.run(None, dict(inputs, **{name: inputs[name].astype(dtype)}))
