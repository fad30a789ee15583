"""Numpy reference of the PagedAttention op (domain ort_lora): the oracle of its kernel tests.

Semantics:
  Inputs are a packed batch of B sequences, T new tokens in all. Sequence b owns rows
  [cu[b], cu[b+1]) of query [T, H*D], key and value [T, KVH*D] (cu = cumulative_sequence_length),
  and already has past_seqlens[b] tokens in the paged caches key_cache / value_cache
  [num_blocks, block_size, KVH, D]. Its new token i has position p = past_seqlens[b] + i.

  Rotary (do_rotary=1): cos_cache / sin_cache [max_pos, R/2], rotary_dim R = 2 * cos.shape[1]
  <= D, applied to every query and key head at position p; channels >= R pass through.
  Non-interleaved (HF rotate_half) rotates the halves x[:R/2], x[R/2:R]; interleaved rotates
  the pairs (x[2i], x[2i+1]):  (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).

  Cache write: the new tokens' K (after rotary) and V go to slot s = slot_mapping[t]
  (block s // block_size, offset s % block_size); s = -1 skips the write. Without slot_mapping,
  s = block_table[b][p // block_size] * block_size + p % block_size.

  Attention of new token i of sequence b (query head h, kv head h // (H / KVH)): keys and values
  at positions j = 0..p (causal, bottom-right aligned); positions < past_seqlens[b] are read from
  the caches through block_table[b] as they were BEFORE this call's writes, the new tokens' own
  K/V from the key/value inputs. local_window_size w >= 0 keeps only j >= p - w (w + 1 keys);
  -1 = no window. scores = scale * q.k (scale 0 means 1 / sqrt(D)); softcap > 0 maps scores to
  softcap * tanh(scores / softcap) before the softmax. Output [T, H*D].
"""

from __future__ import annotations

import numpy as np


def rotary(x, positions, cos_cache, sin_cache, interleaved):
    """Rotary embedding of x [T, heads, D] at positions [T] (int); returns a new array."""
    half = cos_cache.shape[1]
    cos = cos_cache[positions][:, None, :]  # [T, 1, R/2]
    sin = sin_cache[positions][:, None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
        out[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out


def _token_positions(cu, past):
    """Position p of every packed token: [T] int64."""
    return np.concatenate(
        [past[b] + np.arange(cu[b + 1] - cu[b]) for b in range(len(past))] or [np.zeros(0)]
    ).astype(np.int64)


def _slots(cu, past, block_table, block_size, slot_mapping):
    """Cache slot of every packed token ([T] int64, -1 = no write)."""
    if slot_mapping is not None:
        return np.asarray(slot_mapping, dtype=np.int64)
    slots = []
    for b in range(len(past)):
        p = past[b] + np.arange(cu[b + 1] - cu[b])
        slots.append(block_table[b][p // block_size].astype(np.int64) * block_size + p % block_size)
    return np.concatenate(slots or [np.zeros(0, np.int64)])


def _gather_past(cache, block_table_row, past, block_size):
    """Rows 0..past-1 of one sequence from a paged cache: [past, KVH, D]."""
    j = np.arange(past)
    return cache[block_table_row[j // block_size], j % block_size]


def _attend(q, k, v, positions, window, scale, softcap):
    """q [n, H, D] at positions [n]; k, v [L, KVH, D] at positions 0..L-1 -> [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [L, H, D]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) * scale  # [H, n, L]
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    j = np.arange(k.shape[0])[None, :]
    visible = j <= positions[:, None]  # [n, L]
    if window >= 0:
        visible &= j >= positions[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", weights, v)


def paged_attention(
    query,
    key,
    value,
    key_cache,
    value_cache,
    cumulative_sequence_length,
    past_seqlens,
    block_table,
    cos_cache=None,
    sin_cache=None,
    slot_mapping=None,
    *,
    num_heads,
    kv_num_heads,
    scale=0.0,
    do_rotary=0,
    rotary_interleaved=0,
    local_window_size=-1,
    softcap=0.0,
):
    """The op's semantics (module docstring), computed in float64.

    Returns (output [T, num_heads * D] float32, key_cache_after, value_cache_after): the caches
    after the write, as new arrays; the inputs are not modified.
    """
    num_tokens = query.shape[0]
    head_size = query.shape[1] // num_heads
    block_size = key_cache.shape[1]
    cu = np.asarray(cumulative_sequence_length, dtype=np.int64)
    past = np.asarray(past_seqlens, dtype=np.int64)
    q = query.astype(np.float64).reshape(num_tokens, num_heads, head_size)
    k = key.astype(np.float64).reshape(num_tokens, kv_num_heads, head_size)
    v = value.astype(np.float64).reshape(num_tokens, kv_num_heads, head_size)
    positions = _token_positions(cu, past)
    if do_rotary:
        cos, sin = cos_cache.astype(np.float64), sin_cache.astype(np.float64)
        q = rotary(q, positions, cos, sin, rotary_interleaved)
        k = rotary(k, positions, cos, sin, rotary_interleaved)
    scale = scale or 1.0 / np.sqrt(head_size)
    out = np.zeros_like(q)  # [T, H, D]
    for b in range(len(past)):
        rows = slice(cu[b], cu[b + 1])
        if cu[b + 1] == cu[b]:
            continue
        table = block_table[b]
        k_all = np.concatenate([_gather_past(key_cache, table, past[b], block_size), k[rows]])
        v_all = np.concatenate([_gather_past(value_cache, table, past[b], block_size), v[rows]])
        pos = positions[rows]
        out[rows] = _attend(q[rows], k_all, v_all, pos, local_window_size, scale, softcap)
    key_after, value_after = key_cache.copy(), value_cache.copy()
    for t, slot in enumerate(_slots(cu, past, block_table, block_size, slot_mapping)):
        if slot >= 0:
            key_after[slot // block_size, slot % block_size] = k[t]
            value_after[slot // block_size, slot % block_size] = v[t]
    return out.reshape(num_tokens, num_heads * head_size).astype(np.float32), key_after, value_after
