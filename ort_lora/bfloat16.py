"""bfloat16 <-> float32 in numpy (numpy has no bfloat16): bit patterns held as uint16.

Used wherever adapter rows or tensors are bfloat16: safetensors BF16 tensors, bfloat16 rows in
the CPU pool, the CUDA pool's staging, and the numpy references.
"""

from __future__ import annotations

import numpy as np


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of uint16 bfloat16 bit patterns: exact (bits << 16)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)
