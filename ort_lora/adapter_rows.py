"""Adapter rows in a float32 (CPU) pool, by row type (manifest.adapter_dtype; ort_lora/contract.py).

A row of n values at pool element o spans row_elems(n, row_type) pool elements:
  None / "float32"  n float32 values, one per element (a non-float32 pool: its own dtype)
  "bfloat16"        n bfloat16 values, two per element, the first in its low 16 bits
                    (little-endian); an odd n leaves one padding bfloat16
  "float16"         n IEEE float16 values, laid out as bfloat16 rows: exact for adapters
                    saved in float16, 8x finer than bfloat16 for others, values past
                    +-65504 refused (adapters/bounds.py)
  "int8"            element o is the row's float32 scale, then n int8 values q, four per
                    element from byte 4 (o + 1), the last element zero-padded; value k is
                    scale * q[k], scale = max |row| / 127 and q = round(value * 127 / max |row|)
                    (symmetric per row: LoRA rows are centred on zero)
encode_rows gives the pool elements' bit patterns (uint32), decode_rows the values the kernel
reads back, served both in turn: the values an adapter is served with (what PEFT must be given
for an exact comparison, and what DoRA's weight norm uses). An export with adapter_dtype "auto"
gives each adapter its own row type, exact_row_type's: float16 or bfloat16 rows for an adapter
whose every value that type holds exactly (one saved in it), float32 rows for the others. Pure
numpy.
"""

from __future__ import annotations

import numpy as np

from ort_lora.bfloat16 import bfloat16_bits_to_float32, float32_to_bfloat16_bits

# row type -> the LoraSGMV attribute adapter_dtype (an ONNX TensorProto element type)
ROW_TYPES = {"float32": 1, "bfloat16": 16, "float16": 10, "int8": 3}
HALF_TYPES = ("bfloat16", "float16")  # 16-bit values, two per pool element
AUTO = "auto"  # manifest.adapter_dtype: each adapter's rows of its exact_row_type
INT8_MAX = 127


def row_elems(features: int, row_type: str | None) -> int:
    """Pool elements a row of `features` values spans."""
    if row_type in HALF_TYPES:
        return -(-features // 2)
    if row_type == "int8":
        return 1 + -(-features // 4) if features else 0
    return features


def encode_rows(rows: np.ndarray, row_type: str) -> np.ndarray:
    """float32 rows [..., n] -> uint32 [..., row_elems(n)]: the pool elements' bit patterns of
    bfloat16, float16 or int8 rows."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n = rows.shape[-1]
    if row_type in HALF_TYPES:
        # [..., n] uint16, the first of a pair low; float16: numpy rounds to nearest even
        bits = half_bits(rows, row_type)
        if n % 2:
            bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], 1), np.uint16)], axis=-1)
        return np.ascontiguousarray(bits).view("<u4")
    if row_type != "int8":
        raise ValueError(f"encode_rows takes bfloat16, float16 or int8 rows, got {row_type!r}")
    out = np.zeros((*rows.shape[:-1], row_elems(n, "int8")), np.uint32)
    if n:
        # max |row| without a |rows| temporary; abs: a zero row's scale is +0, not -0
        peak = np.abs(np.maximum(rows.max(axis=-1), -rows.min(axis=-1)))
        out[..., 0] = (peak / INT8_MAX).astype(np.float32).view(np.uint32)
        inv = np.divide(INT8_MAX, peak, out=np.zeros_like(peak), where=peak > 0)
        q = rows * inv[..., None]
        np.rint(q, out=q)  # |q| <= 127: the peak maps to +-127
        out.view(np.int8)[..., 4 : 4 + n] = q
    return out


def decode_rows(elems: np.ndarray, features: int, row_type: str) -> np.ndarray:
    """float32 [..., features]: the values of rows stored as `elems` [..., row_elems] (any
    4-byte dtype: float32 pool elements or their uint32 bit patterns)."""
    elems = np.ascontiguousarray(elems).view(np.uint32)
    if row_type == "bfloat16":
        return bfloat16_bits_to_float32(elems.view("<u2")[..., :features])
    if row_type == "float16":
        return elems.view("<f2")[..., :features].astype(np.float32)
    if row_type != "int8":
        raise ValueError(f"decode_rows takes bfloat16, float16 or int8 rows, got {row_type!r}")
    if not features:
        return np.zeros((*elems.shape[:-1], 0), np.float32)
    scale = elems[..., :1].view(np.float32)
    q = np.ascontiguousarray(elems[..., 1:]).view(np.int8)[..., :features]
    return scale * q.astype(np.float32)


def exact_row_type(rows) -> str | None:
    """The 16-bit row type that holds every value of the float32 arrays `rows` exactly:
    "float16" (the finer one, tried first) or "bfloat16"; None when neither does (float32
    rows)."""
    rows = [np.asarray(r, np.float32) for r in rows]
    with np.errstate(over="ignore"):  # past +-65504: inf, not exact
        if all(np.array_equal(r.astype(np.float16), r) for r in rows):
            return "float16"
    if all(not (r.view(np.uint32) & 0xFFFF).any() and np.isfinite(r).all() for r in rows):
        return "bfloat16"
    return None


def half_bits(values: np.ndarray, row_type: str) -> np.ndarray:
    """uint16 bit patterns of float32 values as bfloat16 or float16 (nearest even)."""
    if row_type == "bfloat16":
        return float32_to_bfloat16_bits(values)
    with np.errstate(over="ignore"):  # past +-65504: inf (adapters/bounds.py refuses those)
        return np.asarray(values, np.float32).astype("<f2").view("<u2")


def served(values: np.ndarray, row_type: str | None) -> np.ndarray:
    """float32 values as rows of row_type hold them (the last axis is the row)."""
    if row_type in (None, "float32"):
        return np.asarray(values, np.float32)
    return decode_rows(encode_rows(values, row_type), np.shape(values)[-1], row_type)
