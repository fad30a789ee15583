"""PagedAttention (domain ort_lora, CPU float32) against its numpy reference, the reference
against a dense causal attention on an unpaged layout, and a pool bound through IOBinding."""

from __future__ import annotations

import numpy as np
import pytest
from paged_attention_cases import (
    ATOL,
    RTOL,
    check_against_reference,
    make_case,
    rotary_tables,
    run_kernel,
    session,
)
from rerun_with import assert_passes_with

from ort_lora.ops.paged_attention_ref import paged_attention

# ---- kernel vs reference ---------------------------------------------------------------------

MIXED = [(0, 37), (50, 1), (17, 5), (130, 1), (0, 1), (33, 16)]  # prefill chunks + decode


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (16, 2)], ids=["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("rotary", ["none", "half", "interleaved"])
def test_mixed_batch(heads, head_size, rotary, rng):
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
def test_variants(variant, rng):
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
def test_sizes(size, window, rng):
    inputs = make_case(rng, SIZES[size], 8, 1, 64, rotary_half=32)
    check_against_reference(
        inputs, num_heads=8, kv_num_heads=1, do_rotary=1, local_window_size=window
    )


def test_slot_mapping_elsewhere(rng):
    """slot_mapping decides where K/V go, even outside the block table (here: spare blocks)."""
    inputs = make_case(rng, [(20, 3), (0, 4)], 4, 2, 64, block_size=4)
    used = set(inputs["block_table"][inputs["block_table"] >= 0].tolist())
    spare = [b for b in range(inputs["key_cache"].shape[0]) if b not in used]
    slots = np.array([spare[0] * 4 + i for i in range(4)] + [spare[1] * 4 + i for i in range(3)])
    inputs["slot_mapping"] = rng.permutation(slots).astype(np.int32)
    check_against_reference(inputs, num_heads=4, kv_num_heads=2)


def test_slot_mapping_needs_no_blocks_for_new_tokens(rng):
    """With slot_mapping, the new tokens' block_table entries are never read (may be -1)."""
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
def test_reference_matches_dense_attention(attrs, rng):
    """Whole sequences attend densely; the same sequences split into a paged past (rotated
    keys in the cache) and new tokens must give the reference the same last rows."""
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


def test_iobinding_pool_written_in_place_and_read_by_next_step(rng):
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


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_narrower_isa_kernels(isa):
    """The AVX2 and baseline copies of the kernel (forced with ORT_LORA_ATTENTION_ISA) pass
    the value tests."""
    cases = "mixed_batch or variants or sizes or cut_never"
    assert_passes_with(__file__, cases, "ORT_LORA_ATTENTION_ISA", isa)


# ---- a row's bits never depend on how a call is cut ------------------------------------------

CUTS = {
    "gqa3": dict(num_heads=9, kv_num_heads=3, head_size=64, block_size=16),
    "block_size_5": dict(num_heads=4, kv_num_heads=2, head_size=64, block_size=5),
    # a prompt's rows take the block form in the AVX2 and baseline copies (32 = 4 and 8 of
    # their registers), a decode's the per-row form; 128 in the AVX-512 copy (8 registers)
    "head_size_32": dict(num_heads=8, kv_num_heads=2, head_size=32, block_size=16),
    "head_size_128": dict(num_heads=4, kv_num_heads=1, head_size=128, block_size=16),
    "window_softcap": dict(
        num_heads=4, kv_num_heads=1, head_size=40, block_size=16, local_window_size=300,
        softcap=2.0,
    ),
}  # fmt: skip


def _sequence_calls(rng, length, cuts, others, spec):
    """One sequence of `length` tokens run in calls of the sizes in `cuts` (each call's past
    in the cache from the calls before), beside `others` sequences of random (past, new) in
    every call; returns the sequence's output rows, concatenated."""
    attrs = {k: v for k, v in spec.items() if k not in ("head_size", "block_size")}
    attrs.update(do_rotary=1)
    d, bs = spec["head_size"], spec["block_size"]
    whole = make_case(rng, [(0, length)], spec["num_heads"], spec["kv_num_heads"], d, bs, d // 2)
    caches = {name: whole[name] for name in ("key_cache", "value_cache")}
    outputs, past = [], 0
    for new in cuts:
        extra = [(int(rng.integers(0, 600)), int(rng.integers(1, 40))) for _ in range(others)]
        call = make_case(rng, [(past, new), *extra], spec["num_heads"], spec["kv_num_heads"], d,
                         bs, d // 2)  # fmt: skip
        blocks = -(-length // bs)  # the sequence's blocks: its own, after the others'
        table = call["block_table"]
        width = max(table.shape[1], blocks)
        call["block_table"] = np.full((table.shape[0], width), -1, np.int32)
        call["block_table"][:, : table.shape[1]] = table
        call["block_table"][0, :blocks] = np.arange(blocks) + call["key_cache"].shape[0]
        for name in ("key_cache", "value_cache"):
            call[name] = np.concatenate([call[name], caches[name]])
        for name in ("query", "key", "value"):
            call[name][:new] = whole[name][past : past + new]
        call["cos_cache"], call["sin_cache"] = rotary_tables(length + 1, d // 2)
        outputs.append(run_kernel(call, **attrs)[:new])
        for name in ("key_cache", "value_cache"):
            caches[name] = call[name][-caches[name].shape[0] :]
        past += new
    return np.concatenate(outputs)


@pytest.mark.parametrize("spec", sorted(CUTS))
def test_cut_never_changes_a_row(spec, rng):
    """The same sequence's attention, to the bit, whether it runs in one call alone, as a
    cached prefix and a tail (the prefix cache), in chunks beside other sequences (chunked
    prefill in a mixed step), or token by token with other sequences' decodes (whose count
    decides whether long contexts are split over threads)."""
    spec, length = CUTS[spec], 700
    seed = int(rng.integers(1 << 30))
    runs = {
        "whole": ([length], 0),
        "prefix + tail": ([512, length - 512], 0),
        "chunks among others": ([100, 211, 37, 256, 96], 3),
        "decode alone": ([length - 2, 1, 1], 0),  # its context split over threads
        "decode among others": ([length - 2, 1, 1], 70),  # enough items: not split
    }
    outs = {
        name: _sequence_calls(np.random.default_rng(seed), length, cuts, others, spec)
        for name, (cuts, others) in runs.items()
    }
    for name, out in outs.items():
        np.testing.assert_array_equal(out, outs["whole"], err_msg=name)
