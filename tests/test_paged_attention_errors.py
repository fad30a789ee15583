"""PagedAttention input validation: every bad input, attribute or dtype gets an error that
names it and the expected value."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto
from paged_attention_cases import make_case, rotary_tables, run_kernel, session

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
def test_bad_input_is_named(case, rng):
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
def test_bad_attribute_is_named(attrs, message, rng):
    with pytest.raises(Exception, match=re.escape(message)):
        session(tuple(sorted(bad_case(rng))), **attrs)


def test_cache_outputs_are_refused(rng):
    inputs = bad_case(rng)
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
def test_bad_dtype_is_named(name, dtype, onnx_dtype, rng):
    """ORT checks element types against the op's declared types when the model loads."""
    inputs = bad_case(rng)
    with pytest.raises(Exception, match=rf"Type 'tensor\(\w+\)' of input parameter \({name}\)"):
        sess = session(
            tuple(sorted(inputs)), dtypes=((name, onnx_dtype),), num_heads=4, kv_num_heads=2
        )
        sess.run(None, dict(inputs, **{name: inputs[name].astype(dtype)}))
