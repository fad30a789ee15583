"""Adapter row types in the float32 pool (ort_lora/adapter_rows.py): the bytes LoraSGMV reads.

The op tests (test_lora_sgmv.py) check the kernel against the reference on rows these functions
write; here the rows themselves: their length in pool elements, the int8 scale and rounding,
and the bit layout the op contract states (lora_sgmv_op.h), read back independently."""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora.adapter_rows import decode_rows, encode_rows, row_elems, served
from ort_lora.bfloat16 import bfloat16_bits_to_float32, float32_to_bfloat16_bits


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 576, 1537])
def test_row_elems(n):
    assert row_elems(n, None) == row_elems(n, "float32") == n
    assert row_elems(n, "bfloat16") == row_elems(n, "float16") == (n + 1) // 2
    assert row_elems(n, "int8") == 1 + (n + 3) // 4
    assert row_elems(0, "int8") == 0


@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 577])
def test_int8_rows_layout_and_rounding(n, rng):
    rows = (rng.standard_normal((2, 3, n)) * rng.uniform(0.01, 10, (2, 3, 1))).astype(np.float32)
    elems = encode_rows(rows, "int8")
    assert elems.dtype == np.uint32 and elems.shape == (2, 3, row_elems(n, "int8"))
    scale = elems[..., 0].view(np.float32)  # element 0: the row's float32 scale
    np.testing.assert_allclose(scale, np.abs(rows).max(axis=-1) / 127, rtol=1e-6)
    q = elems[..., 1:].copy().view(np.int8)  # then int8 values, little-endian, zero padded
    assert (q[..., n:] == 0).all()
    q = q[..., :n].astype(np.float32)
    assert np.abs(q).max() == 127  # the peak maps to +-127
    np.testing.assert_array_equal(q, np.rint(rows * (127 / np.abs(rows).max(-1, keepdims=True))))
    values = decode_rows(elems, n, "int8")
    np.testing.assert_array_equal(values, scale[..., None] * q)
    assert (np.abs(values - rows) <= 0.5 * scale[..., None] * (1 + 1e-6)).all()
    np.testing.assert_array_equal(served(rows, "int8"), values)


def test_int8_zero_rows_and_empty_rows():
    rows = np.zeros((2, 5), np.float32)
    elems = encode_rows(rows, "int8")
    assert not elems.any()  # scale 0, values 0
    assert not decode_rows(elems, 5, "int8").any()
    empty = encode_rows(np.zeros((3, 0), np.float32), "int8")
    assert empty.shape == (3, 0) and decode_rows(empty, 0, "int8").shape == (3, 0)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_bfloat16_rows_are_pairs_low_half_first(n, rng):
    rows = rng.standard_normal((4, n)).astype(np.float32)
    elems = encode_rows(rows, "bfloat16")
    assert elems.shape == (4, row_elems(n, "bfloat16"))
    bits = float32_to_bfloat16_bits(rows)
    np.testing.assert_array_equal(elems[:, 0] & 0xFFFF, bits[:, 0])
    if n > 1:
        np.testing.assert_array_equal(elems[:, 0] >> 16, bits[:, 1])
    np.testing.assert_array_equal(decode_rows(elems, n, "bfloat16"), bfloat16_bits_to_float32(bits))
    np.testing.assert_array_equal(served(rows, None), rows)


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_float16_rows_are_ieee_pairs_low_half_first(n, rng):
    rows = rng.standard_normal((4, n)).astype(np.float32)
    elems = encode_rows(rows, "float16")
    assert elems.shape == (4, row_elems(n, "float16"))
    halves = rows.astype(np.float16).view(np.uint16)  # IEEE binary16, nearest even
    np.testing.assert_array_equal(elems[:, 0] & 0xFFFF, halves[:, 0])
    if n > 1:
        np.testing.assert_array_equal(elems[:, 0] >> 16, halves[:, 1])
    np.testing.assert_array_equal(decode_rows(elems, n, "float16"), rows.astype(np.float16))


def test_float16_rows_serve_float16_values_exactly():
    """Every finite float16 (subnormals, the largest, both signs) comes back as it went in: an
    adapter saved in float16 is served exactly by float16 rows."""
    values = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    values = values[np.isfinite(values)].astype(np.float32).reshape(-1, 4)
    np.testing.assert_array_equal(served(values, "float16"), values)
    rounded = served(np.array([[1 + 2**-12, 2**-25, 70000.0]], np.float32), "float16")
    assert rounded[0, 0] == 1 and rounded[0, 1] == 0 and np.isinf(rounded[0, 2])


def test_unknown_row_type():
    with pytest.raises(ValueError, match="bfloat16, float16 or int8"):
        encode_rows(np.zeros((1, 4), np.float32), "int4")
