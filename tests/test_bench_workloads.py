"""Benchmark workloads and metrics against direct numpy oracles (no model needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ort_lora.bench import workloads as W
from ort_lora.bench.metrics import RequestTimes, summarize

VOCAB = 1000


@pytest.mark.parametrize("pattern", ["distinct", "uniform", "identical", "base"])
def test_deterministic_patterns(pattern):
    n, a = 37, 5
    w = W.popularity_workload(pattern, n, 6, 9, VOCAB, num_adapters=a, seed=3)
    expected = {
        "distinct": list(range(n)),
        "uniform": [i % a for i in range(n)],
        "identical": [0] * n,
        "base": [None] * n,
    }[pattern]
    assert [r.adapter for r in w.requests] == expected
    assert w.num_adapters == {"distinct": n, "base": 0}.get(pattern, a)
    assert all(len(r.prompt_ids) == 6 and r.max_tokens == 9 for r in w.requests)
    assert all(VOCAB // 4 <= t < VOCAB for r in w.requests for t in r.prompt_ids)
    assert w.output_tokens == 9 * n


def test_skewed_follows_zipf():
    n, a, alpha = 40_000, 8, 1.5
    w = W.popularity_workload("skewed", n, 2, 1, VOCAB, num_adapters=a, seed=11)
    counts = np.bincount([r.adapter for r in w.requests], minlength=a) / n
    zipf = np.array([1 / k**alpha for k in range(1, a + 1)])
    np.testing.assert_allclose(counts, zipf / zipf.sum(), atol=0.01)


def test_trace_arrivals_and_lengths():
    rate, cv = 5.0, 2.0
    w = W.slora_trace(20_000, rate, cv, (3, 9), (2, 4), VOCAB, num_adapters=7, seed=5)
    arrivals = np.array([r.arrival_s for r in w.requests])
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.07)
    plens = {len(r.prompt_ids) for r in w.requests}
    assert plens == set(range(3, 10))
    assert {r.max_tokens for r in w.requests} == {2, 3, 4}
    assert {r.adapter for r in w.requests} == set(range(7))


def test_workloads_are_seeded_and_round_trip():
    a = W.slora_trace(30, 2.0, 1.0, (4, 8), (4, 8), VOCAB, 4, seed=1)
    b = W.slora_trace(30, 2.0, 1.0, (4, 8), (4, 8), VOCAB, 4, seed=1)
    c = W.slora_trace(30, 2.0, 1.0, (4, 8), (4, 8), VOCAB, 4, seed=2)
    assert a == b and a != c
    assert W.Workload.from_json(a.to_json()) == a


def test_bad_workload_arguments_name_the_problem():
    with pytest.raises(ValueError, match="unknown adapter pattern 'zipf'"):
        W.popularity_workload("zipf", 4, 2, 2, VOCAB)
    with pytest.raises(ValueError, match="rate and cv must be > 0"):
        W.slora_trace(4, 0.0, 1.0, (1, 2), (1, 2), VOCAB, 2)
    with pytest.raises(ValueError, match="prompt length must be >= 1"):
        W.popularity_workload("base", 4, 0, 2, VOCAB)


def _percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile written out (the oracle for np.percentile's default)."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def test_summarize_matches_hand_computation():
    rng = np.random.default_rng(7)
    times = []
    for _ in range(9):
        arrival = float(rng.uniform(0, 2))
        tokens = list(arrival + np.cumsum(rng.uniform(0.01, 0.2, size=rng.integers(1, 12))))
        times.append(RequestTimes(arrival, tokens))
    total = sum(len(t.token_s) for t in times)
    got = summarize(times, total)
    end = max(t.token_s[-1] for t in times)
    ttft = [t.token_s[0] - t.arrival_s for t in times]
    itl = [b - a for t in times for a, b in zip(t.token_s, t.token_s[1:])]
    assert got["output_tok_s"] == pytest.approx(total / end)
    assert got["requests_s"] == pytest.approx(9 / end)
    for p in (50, 90, 99):
        assert got[f"ttft_p{p}_ms"] == pytest.approx(1e3 * _percentile(ttft, p))
        assert got[f"itl_p{p}_ms"] == pytest.approx(1e3 * _percentile(itl, p))


def test_summarize_refuses_a_wrong_token_count():
    times = [RequestTimes(0.0, [0.1, 0.2])]
    with pytest.raises(ValueError, match="produced 2 output tokens; expected 3"):
        summarize(times, 3)
    assert summarize(times, (1, 3))["output_tokens"] == 2
    with pytest.raises(ValueError, match=r"produced 2 output tokens; expected \(3, 5\)"):
        summarize(times, (3, 5))


def test_json_schema_workload():
    """The uniform workload's requests, each with a schema of its own that survives the
    JSON round trip of a run's spec; a run may end each output early (its grammar's end)."""
    jsonschema = pytest.importorskip("jsonschema")
    w = W.json_schema_workload(12, 5, 40, VOCAB, num_adapters=4, seed=1)
    free = W.popularity_workload("uniform", 12, 5, 40, VOCAB, num_adapters=4, seed=1)
    assert [(r.prompt_ids, r.adapter) for r in w.requests] == [
        (r.prompt_ids, r.adapter) for r in free.requests
    ]
    schemas = [json.dumps(r.schema, sort_keys=True) for r in w.requests]
    assert len(set(schemas)) == 12
    for r in w.requests:
        jsonschema.Draft202012Validator.check_schema(r.schema)
    assert W.Workload.from_json(json.loads(json.dumps(w.to_json()))) == w
    assert w.expected_tokens == (12, 480) and free.expected_tokens == 480


def test_composed_workload_and_the_variants_runs():
    """Request i composes adapters i and i + 1 (mod the count) over the uniform pattern's
    prompts, survives the spec's JSON round trip, and the engine system gives it the list of
    both LoRARequests at weight 1/2; the variants experiment alternates its rows twice, the
    DoRA row marked for the DoRA copies of the adapters."""
    from ort_lora.bench import plan
    from ort_lora.bench.systems.ort_lora_engine import _lora_of
    from ort_lora.lora_request import LoRARequest

    w = W.composed_workload(6, 5, 4, VOCAB, num_adapters=4, k=2, seed=1)
    free = W.popularity_workload("uniform", 6, 5, 4, VOCAB, num_adapters=4, seed=1)
    assert [r.prompt_ids for r in w.requests] == [r.prompt_ids for r in free.requests]
    assert [(r.adapter, r.compose) for r in w.requests][3:5] == [(3, (0,)), (0, (1,))]
    assert W.Workload.from_json(json.loads(json.dumps(w.to_json()))) == w
    loras = [LoRARequest(f"a{i}", i + 1, f"/a{i}") for i in range(4)]
    assert [(r.lora_name, r.weight) for r in _lora_of(w.requests[3], loras)] == [
        ("a3", 0.5), ("a0", 0.5)
    ]  # fmt: skip
    assert _lora_of(free.requests[3], loras) is loras[3]
    with pytest.raises(ValueError, match=r"k must be in \[1, num_adapters = 4\], got 5"):
        W.composed_workload(6, 5, 4, VOCAB, num_adapters=4, k=5)
    runs = [
        r
        for r in plan.experiments(plan.QUICK, VOCAB, {"ort-lora"})
        if r["experiment"] == "variants"
    ]
    assert [r["label"] for r in runs] == list(plan.VARIANT_ROWS) * 2
    assert [bool(r["options"].get("dora")) for r in runs] == [False, True, False, False] * 2
