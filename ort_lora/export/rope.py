"""Rotary-embedding caches: cos/sin tables [max_positions, head_dim / 2] for PagedAttention.

Semantics follow Hugging Face's rope (non-interleaved halves): for position p and frequency i,
angle = p * inv_freq[i]; inv_freq[i] = theta ** (-2i / dim), rescaled by `linear` (divide by
factor) or `llama3` (smooth per-wavelength interpolation) scaling.
"""

from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """inv_freq float64 [head_dim / 2]."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def cos_sin_cache(
    max_positions: int, head_dim: int, theta: float, scaling: dict | None
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [max_positions, head_dim / 2]."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim / 2]
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
