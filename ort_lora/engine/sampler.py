"""The sampler: logits of one step -> next tokens (+ logprobs), pure numpy, vectorized over rows.

Per row, in this order (vLLM v1's):
  1. penalties on the raw logits: repetition (prompt + output tokens: positive logits divided,
     negative multiplied), then frequency (x count in the output), then presence (output)
  1b. the request's logit_bias is added; tokens its grammar forbids (structured outputs,
     engine/grammar.py) get -inf
  2. greedy rows (temperature < 1e-5): argmax of the penalized logits
  3. other rows: / temperature -> min_p (drop p < min_p * p_max) -> top_k (keep logits >= the
     k-th largest) -> top_p (keep the smallest most-likely set whose mass reaches top_p) ->
     one draw from the row's own generator (seeded requests are reproducible)
Logprobs are the log-softmax of the RAW logits (vLLM's default "raw_logprobs"): the sampled
token first, then the top-k, each with its rank (1 = most likely).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ort_lora.outputs import Logprob, PositionLogprobs
from ort_lora.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """One logits row's request state (references, not copies).

    generator: the request's own np.random.Generator (np.random.default_rng(params.seed), kept
    for the request's life), or None to draw from the engine-level generator.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: np.random.Generator | None = None
    bias: tuple[np.ndarray, np.ndarray] | None = None  # (token ids, biases) of logit_bias
    allowed: np.ndarray | None = None  # bool [V]: what the grammar allows next; None = all


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # int64 [B]
    logprobs: list[PositionLogprobs | None]  # per row; None where params.logprobs is None
    sampled_logprobs: list[float | None]  # raw logprob of the sampled token, same rule

    def row(self, i: int) -> tuple[int, PositionLogprobs | None, float | None]:
        """(token, its logprobs entry, its raw logprob) of row i."""
        return int(self.token_ids[i]), self.logprobs[i], self.sampled_logprobs[i]


def make_generator(params: SamplingParams) -> np.random.Generator | None:
    """The per-request generator: seeded when params.seed is set, else None (engine rng)."""
    return None if params.seed is None else np.random.default_rng(params.seed)


def sample(
    logits: np.ndarray, rows: Sequence[SampleRow], rng: np.random.Generator
) -> SamplerOutput:
    """Next token of every row. logits: [B, vocab] float; rng: the engine-level generator."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab], got shape {list(logits.shape)}")
    raw = np.asarray(logits, dtype=np.float32)  # [B, V]
    x = apply_constraints(apply_penalties(raw, rows), raw, rows)  # [B, V]
    tokens = np.empty(len(rows), np.int64)
    greedy = np.array([r.params.is_greedy for r in rows], bool)
    if greedy.all():  # the common case: no copy of the [B, V] logits
        tokens[:] = np.argmax(x, axis=1)
    elif greedy.any():
        tokens[greedy] = np.argmax(x[greedy], axis=1)
    rand = np.flatnonzero(~greedy)
    if len(rand):
        probs = truncated_probs(x[rand], [rows[i].params for i in rand])  # [b, V]
        gens = [rows[i].generator or rng for i in rand]
        tokens[rand] = _draw(probs, gens)
    lps, sampled = _row_logprobs(raw, tokens, rows)
    return SamplerOutput(tokens, lps, sampled)


def apply_penalties(logits: np.ndarray, rows: Sequence[SampleRow]) -> np.ndarray:
    """Repetition, frequency and presence penalties: a new array, or `logits` itself (not to
    be modified) when no row has any."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    out = logits.copy()
    vocab = logits.shape[1]
    counts = np.stack([_bincount(rows[i].output_token_ids, vocab) for i in idx])  # [k, V]
    seen = counts > 0
    seen |= np.stack([_bincount(rows[i].prompt_token_ids, vocab) > 0 for i in idx])
    # float64: any finite penalty a request may give (1e-300 .. 1e300) stays nonzero and finite
    rep = np.array([rows[i].params.repetition_penalty for i in idx], np.float64)[:, None]
    freq = np.array([rows[i].params.frequency_penalty for i in idx], np.float64)[:, None]
    pres = np.array([rows[i].params.presence_penalty for i in idx], np.float64)[:, None]
    x = out[idx].astype(np.float64)  # [k, V]
    with np.errstate(over="ignore"):  # x * 1e300 may reach inf: clipped below
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x -= freq * counts + pres * (counts > 0)
    out[idx] = np.clip(x, -_F32_MAX, _F32_MAX)  # back in float32 range: no inf, no NaN later
    return out


_F32_MAX = float(np.finfo(np.float32).max)


def apply_constraints(x: np.ndarray, raw: np.ndarray, rows: Sequence[SampleRow]) -> np.ndarray:
    """logit_bias added, tokens the grammar forbids at -inf: in a copy when x is still the raw
    logits (they give the logprobs), in place otherwise; x itself when no row has either."""
    idx = [i for i, r in enumerate(rows) if r.bias is not None or r.allowed is not None]
    if not idx:
        return x
    out = x.copy() if x is raw else x
    for i in idx:
        if rows[i].bias is not None:
            ids, values = rows[i].bias
            out[i, ids] += values
        if rows[i].allowed is not None:  # copyto: ~25x faster than boolean indexing here
            np.copyto(out[i], -np.inf, where=~rows[i].allowed)
    return out


def _bincount(token_ids: Sequence[int], vocab: int) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < vocab)]
    return np.bincount(ids, minlength=vocab).astype(np.float32)  # [V]


def truncated_probs(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Probabilities after temperature, min_p, top_k and top_p; dropped tokens get 0. [b, V]"""
    temp = np.array([p.temperature for p in params], np.float32)[:, None]
    x = x / temp
    min_p = np.array([p.min_p for p in params], np.float32)[:, None]
    if min_p.any():
        probs = _softmax(x)
        x = np.where(probs < min_p * probs.max(axis=1, keepdims=True), -np.inf, x)
    vocab = x.shape[1]
    top_k = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], np.int64)
    if (top_k < vocab).any():
        kth = -np.sort(-x, axis=1)[np.arange(len(x)), top_k - 1][:, None]  # [b, 1]
        x = np.where(x < kth, -np.inf, x)
    probs = _softmax(x)
    top_p = np.array([p.top_p for p in params], np.float32)[:, None]
    if (top_p < 1.0).any():
        desc = -np.sort(-probs, axis=1)  # [b, V]
        mass_before = np.cumsum(desc, axis=1) - desc
        keep = np.maximum((mass_before < top_p).sum(axis=1), 1)  # [b]
        threshold = desc[np.arange(len(x)), keep - 1][:, None]
        probs = np.where(probs < threshold, 0.0, probs)
    return probs


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _draw(probs: np.ndarray, gens: Sequence[np.random.Generator]) -> np.ndarray:
    """One inverse-CDF draw per row, each from its own generator."""
    cdf = np.cumsum(probs, axis=1, dtype=np.float64)  # [b, V]
    u = np.array([g.random() for g in gens]) * cdf[:, -1]  # [b]
    picks = [np.searchsorted(c, v, side="right") for c, v in zip(cdf, u)]
    return np.minimum(np.array(picks, np.int64), probs.shape[1] - 1)


_SCRATCH_BYTES = 8 << 20  # each of a thread's two log-softmax buffers holds at most this
_scratch = threading.local()


def log_softmax_chunks(x: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Row-wise log-softmax of x [n, V] in float32, by chunks of rows: yields (start, lp),
    lp = log-softmax of x[start : start + len(lp)], held in this thread's two scratch buffers
    and valid until the next chunk. The sampler runs this every step that asks logprobs: new
    [n, V] arrays there cost more in fresh pages than the math (5.4 -> 2.7 ms a step at 32
    rows in `ort-lora serve`), and a long prompt's prompt logprobs stay within the buffers."""
    x = np.asarray(x, dtype=np.float32)
    n, vocab = x.shape
    rows = max(1, _SCRATCH_BYTES // (4 * vocab))
    size = min(n, rows) * vocab
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].size < size:
        bufs = _scratch.bufs = (np.empty(size, np.float32), np.empty(size, np.float32))
    for start in range(0, n, rows):
        part = x[start : start + rows]
        shifted = bufs[0][: part.size].reshape(part.shape)
        exp = bufs[1][: part.size].reshape(part.shape)
        np.subtract(part, part.max(axis=-1, keepdims=True), out=shifted)
        np.exp(shifted, out=exp)
        yield start, np.subtract(shifted, np.log(exp.sum(axis=-1, keepdims=True)), out=shifted)


def _row_logprobs(raw, tokens, rows) -> tuple[list, list]:
    lps: list[PositionLogprobs | None] = [None] * len(rows)
    sampled: list[float | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if idx:
        for start, lp in log_softmax_chunks(raw if len(idx) == len(rows) else raw[idx]):
            for j, i in enumerate(idx[start : start + len(lp)]):
                lps[i] = position_logprobs(lp[j], int(tokens[i]), rows[i].params.logprobs)
                sampled[i] = float(lp[j, tokens[i]])
    return lps, sampled


def position_logprobs(lp: np.ndarray, token: int, k: int) -> PositionLogprobs:
    """{token: Logprob} for one position: `token` first, then the top-k of lp [V], with ranks."""
    k = min(k, len(lp))
    out = {token: Logprob(float(lp[token]), int(np.count_nonzero(lp > lp[token])) + 1)}
    if k == 0:
        return out
    top = top_k(lp, k)
    values = lp[top]
    # every value above one of the k largest is among them: a top token's rank counts the top
    for t, v in zip(top.tolist(), values.tolist()):
        if t not in out:
            out[t] = Logprob(v, int(np.count_nonzero(values > v)) + 1)
    return out


_TOP_K_BLOCK = 64


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of x [V] (1 <= k <= V), largest first, ties by index.
    Only values at or above the k-th largest of the maxima of 64-value blocks can be among
    them (k blocks have a value that high), so a vocabulary-sized row is partitioned over a
    few candidates instead of all of it."""
    blocks = len(x) // _TOP_K_BLOCK
    if blocks > k:
        maxima = x[: blocks * _TOP_K_BLOCK].reshape(blocks, _TOP_K_BLOCK).max(axis=1)
        cand = np.flatnonzero(x >= np.partition(maxima, blocks - k)[blocks - k])
    else:
        cand = np.arange(len(x))
    order = np.lexsort((cand, -x[cand]))[:k]
    return cand[order]


def prompt_logprobs(logits: np.ndarray, next_token_ids: Sequence[int], k: int) -> list:
    """Prompt logprobs of positions: logits [N, V] at prompt positions i, the prompt tokens
    at i + 1 [N]; returns N dicts (the actual token first, then the top-k). The engine puts
    None in front for the first prompt token."""
    if len(logits) != len(next_token_ids):
        raise ValueError(f"{len(logits)} logits rows for {len(next_token_ids)} next tokens")
    out = []
    for start, lp in log_softmax_chunks(logits):
        ids = next_token_ids[start : start + len(lp)]
        out += [position_logprobs(row, int(t), k) for row, t in zip(lp, ids)]
    return out
