"""Rotary-embedding caches: cos/sin tables [max_positions, dim / 2] for PagedAttention.

Semantics follow Hugging Face's rope (non-interleaved halves) over the first `dim` channels of
a head (dim < head_dim: partial rotary, the rest pass through): for position p and frequency i,
angle = p * inv_freq[i]; inv_freq[i] = theta ** (-2i / dim), rescaled by `linear` (divide by
factor) or `llama3` (smooth per-wavelength interpolation) scaling.

`longrope` (Phi-3 "su"): inv_freq[i] = theta ** (-2i / dim) / ext[i], and cos and sin are
multiplied by attention_factor. transformers rotates a sequence of at most
original_max_position_embeddings tokens with ext = short_factor, a longer one with long_factor
at every position (its Phi-3 generate() recomputes the cache when a sequence crosses the
original length). A paged cache cannot re-rotate the keys it holds, so a table uses one list
for all positions, chosen by the context it serves (as vLLM does): long_factor if
max_positions exceeds the original length (exactly transformers on every longer sequence),
else short_factor (exactly transformers on every sequence; export with
--extra max_position_embeddings=<original> to serve that way).
"""

from __future__ import annotations

import math

import numpy as np


def inverse_frequencies(dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """inv_freq float64 [dim / 2] (not longrope: see cos_sin_cache)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
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
    max_positions: int, dim: int, theta: float, scaling: dict | None
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each float32 [max_positions, dim / 2]."""
    gain = 1.0
    if scaling is not None and scaling["rope_type"] == "longrope":
        inv_freq = inverse_frequencies(dim, theta, None) / longrope_factors(scaling, max_positions)
        gain = scaling["attention_factor"]
    else:
        inv_freq = inverse_frequencies(dim, theta, scaling)  # [dim / 2]
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (gain * np.cos(angles)).astype(np.float32), (gain * np.sin(angles)).astype(np.float32)


def longrope_factors(scaling: dict, max_positions: int) -> np.ndarray:
    """The ext factors [dim / 2] of a longrope table serving max_positions (module docstring)."""
    long = max_positions > scaling["original_max_position_embeddings"]
    return np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
