"""Sampler vs direct numpy computations of what each setting allows, on fresh random logits."""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora.engine.sampler import (
    SampleRow,
    apply_penalties,
    make_generator,
    position_logprobs,
    prompt_logprobs,
    sample,
    top_k,
)
from ort_lora.sampling_params import SamplingParams

V = 50


def rows_of(params, n=1, prompt=(1, 2), output=()):
    return [SampleRow(params, list(prompt), list(output), make_generator(params)) for _ in range(n)]


def ref_probs(x, temperature):
    e = np.exp((x - x.max()) / temperature)
    return e / e.sum()


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, V)).astype(np.float32)
    out = sample(logits, rows_of(SamplingParams(temperature=0.0), 7), rng)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))


def test_seeded_rows_reproduce_and_ignore_engine_rng():
    logits = np.random.default_rng(1).standard_normal((1, V)).astype(np.float32)

    def run(seed, engine_seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        row = SampleRow(params, [1], [], make_generator(params))
        eng = np.random.default_rng(engine_seed)
        return [int(sample(logits, [row], eng).token_ids[0]) for _ in range(30)]

    assert run(7, 0) == run(7, 123)
    assert run(7, 0) != run(8, 0)


def draws(logits_row, params, n=4000, seed=0):
    logits = np.repeat(logits_row[None], n, axis=0)
    out = sample(logits, rows_of(params, n), np.random.default_rng(seed))
    return out.token_ids


def check_allowed(tokens, allowed, probs):
    """Every draw is allowed; frequencies follow the renormalized probabilities."""
    assert set(tokens.tolist()) <= set(allowed.tolist())
    want = probs[allowed] / probs[allowed].sum()
    got = np.bincount(tokens, minlength=len(probs))[allowed] / len(tokens)
    assert np.abs(got - want).max() < 0.04


def test_top_k_allowed_set():
    x = np.random.default_rng(2).standard_normal(V).astype(np.float32) * 2
    allowed = np.argsort(-x)[:5]
    tokens = draws(x, SamplingParams(temperature=0.7, top_k=5))
    check_allowed(tokens, allowed, ref_probs(x, 0.7))


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.9])
def test_top_p_allowed_set(top_p):
    x = np.random.default_rng(3).standard_normal(V).astype(np.float32)
    p = ref_probs(x, 0.8)
    order, mass, allowed = np.argsort(-p), 0.0, []
    for t in order:  # smallest most-likely set whose mass reaches top_p
        allowed.append(t)
        mass += p[t]
        if mass >= top_p:
            break
    tokens = draws(x, SamplingParams(temperature=0.8, top_p=top_p))
    check_allowed(tokens, np.array(allowed), p)


def test_min_p_allowed_set():
    x = np.random.default_rng(4).standard_normal(V).astype(np.float32) * 2
    p = ref_probs(x, 1.3)
    allowed = np.flatnonzero(p >= 0.2 * p.max())
    tokens = draws(x, SamplingParams(temperature=1.3, min_p=0.2))
    check_allowed(tokens, allowed, p)


def test_mixed_batch_keeps_each_rows_settings():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    rows = (
        rows_of(SamplingParams(temperature=0.0))
        + rows_of(SamplingParams(top_k=1))
        + rows_of(SamplingParams(top_k=3, seed=1))
    )
    for _ in range(50):
        t = sample(logits, rows, rng).token_ids
        assert t[0] == logits[0].argmax() and t[1] == logits[1].argmax()
        assert t[2] in np.argsort(-logits[2])[:3]


def test_penalties_hand_computed():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]], np.float32)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SampleRow(params, [0, 1], [2, 2, 3])
    # repetition (prompt+output 0,1,2,3): 2/2, -1*2, .5/2, -.5*2; then freq (count) and presence
    want = [1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 3.0, 1.0]
    np.testing.assert_allclose(apply_penalties(logits, [row])[0], want, rtol=1e-6)
    plain = SampleRow(SamplingParams(), [0], [1])
    np.testing.assert_array_equal(apply_penalties(logits, [plain]), logits)


def test_penalties_change_greedy_choice():
    logits = np.array([[5.0, 4.0, 0.0]], np.float32)
    row = SampleRow(SamplingParams(temperature=0, frequency_penalty=2.0), [2], [0])
    assert sample(logits, [row], np.random.default_rng(0)).token_ids[0] == 1


def ref_log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_are_raw_log_softmax_with_ranks():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, V)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=1.5)
    rows = rows_of(params, 3, output=[0, 1]) + rows_of(SamplingParams())
    out = sample(logits, rows, rng)
    assert out.logprobs[3] is None and out.sampled_logprobs[3] is None
    for i in range(3):
        ref = ref_log_softmax(logits[i])
        tok = int(out.token_ids[i])
        order = np.argsort(-ref)
        lp = out.logprobs[i]
        assert list(lp)[0] == tok
        assert set(lp) == {tok, *order[:4].tolist()}
        for t, entry in lp.items():
            assert entry.logprob == pytest.approx(ref[t], abs=1e-5)
            assert entry.rank == int(np.flatnonzero(order == t)[0]) + 1
        assert out.sampled_logprobs[i] == pytest.approx(ref[tok], abs=1e-5)


def test_prompt_logprobs_hold_the_actual_token():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((5, V)).astype(np.float32)
    nxt = rng.integers(0, V, 5)
    got = prompt_logprobs(logits, nxt, 2)
    for row, t, d in zip(logits, nxt, got):
        ref = ref_log_softmax(row)
        assert int(t) in d and d[int(t)].logprob == pytest.approx(ref[t], abs=1e-5)
        assert d[int(t)].rank == int((ref > ref[t]).sum()) + 1
        assert set(np.argsort(-ref)[:2].tolist()) <= set(d)
    with pytest.raises(ValueError, match="logits rows"):
        prompt_logprobs(logits, nxt[:3], 2)


def test_sample_rejects_mismatched_logits(rng):
    with pytest.raises(ValueError, match=r"logits must be \[2, vocab\]"):
        sample(np.zeros((3, V), np.float32), rows_of(SamplingParams(), 2), rng)


@pytest.mark.parametrize("decimals", [0, 1, 6])  # heavy ties .. none
def test_top_k_and_ranks_against_a_full_sort(decimals):
    rng = np.random.default_rng(decimals)
    for size, k in [(49152, 1), (49152, 20), (3000, 46), (3000, 47), (130, 2), (50, 50), (7, 3)]:
        x = np.round(rng.standard_normal(size) * 3, decimals).astype(np.float32)
        x[rng.integers(0, size, 5)] = -np.inf
        top = top_k(x, k)
        assert len(set(top.tolist())) == k
        assert np.array_equal(x[top], np.sort(x)[::-1][:k])  # the k largest, largest first
        tied = x[top[:-1]] == x[top[1:]]
        assert (top[:-1][tied] < top[1:][tied]).all()  # ties by index
        token = int(rng.integers(0, size))
        got = position_logprobs(x, token, k)
        assert list(got)[0] == token and set(got) == {token, *top.tolist()}
        for t, entry in got.items():
            assert entry.logprob == float(x[t])
            assert entry.rank == int((x > x[t]).sum()) + 1


def test_log_softmax_by_chunks_is_one_pass_bit_for_bit(monkeypatch):
    from ort_lora.engine import sampler

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 1000)) * 4).astype(np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nxt = rng.integers(0, 1000, 37)
    whole = prompt_logprobs(x, nxt, 3)
    monkeypatch.setattr(sampler, "_SCRATCH_BYTES", 4 * 1000 * 5)  # 5 rows a chunk
    got = [(start, lp.copy()) for start, lp in sampler.log_softmax_chunks(x)]
    assert [start for start, _ in got] == list(range(0, 37, 5))
    assert np.array_equal(np.concatenate([lp for _, lp in got]), want)
    assert prompt_logprobs(x, nxt, 3) == whole
    asks = SamplingParams(temperature=0, logprobs=2)
    rows = rows_of(asks, 6) + rows_of(SamplingParams(temperature=0)) + rows_of(asks, 6)
    out = sample(x[:13], rows, rng)
    for i, row in enumerate(want[:13]):
        if i == 6:
            assert out.logprobs[i] is None
        else:
            assert out.sampled_logprobs[i] == float(row[out.token_ids[i]])
            assert set(out.logprobs[i]) == {int(out.token_ids[i]), *np.argsort(-row)[:2].tolist()}
