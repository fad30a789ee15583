"""The prefix experiment's parts without a model: the chat and unshared traces (shape,
determinism, JSON), the closed-loop client over a fake engine (each turn re-sends the history
with the engine's own answers), hit-rate and target math, and the plan's rows."""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora.bench import plan, prefix_report
from ort_lora.bench.cli import systems_for
from ort_lora.bench.prefix import (
    ChatTrace,
    chat_trace,
    first_conversations,
    poisson_arrivals,
    turn_counts,
    unshared_trace,
)
from ort_lora.bench.systems import chat_loop
from ort_lora.bench.workloads import Workload

VOCAB = 1000


def small_trace(seed: int = 0, rate: float = 5.0) -> ChatTrace:
    return chat_trace(40, 4, 24, (3, 6), 4, 5, rate, VOCAB, seed)


def test_chat_trace_shape():
    t = small_trace()
    assert t.num_requests == 40 and t.output_tokens == 40 * 5
    assert len(t.system_prompts) == 4 and all(len(p) == 24 for p in t.system_prompts)
    assert len({p for p in t.system_prompts}) == 4  # each adapter's own system prompt
    for c, conv in enumerate(t.conversations):
        assert conv.adapter == conv.system == c % 4
        assert 1 <= len(conv.turns) <= 4
        assert all(3 <= len(u) <= 6 for u in conv.turns)
        assert all(VOCAB // 4 <= tok < VOCAB for u in conv.turns for tok in u)
    starts = [c.arrival_s for c in t.conversations]
    assert starts[0] == 0.0 and starts == sorted(starts)


def test_trace_is_deterministic_per_seed():
    assert small_trace(0).to_json() == small_trace(0).to_json()
    assert small_trace(0).to_json() != small_trace(1).to_json()


def test_turn_counts_sum_to_the_requests():
    rng = np.random.default_rng(3)
    for n in (1, 7, 256):
        counts = turn_counts(rng, n, 4)
        assert sum(counts) == n and all(1 <= k <= 4 for k in counts)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        turn_counts(rng, 5, 0)


def test_poisson_arrivals_mean_gap():
    arrivals = poisson_arrivals(np.random.default_rng(0), 20_000, 4.0)
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert np.mean(np.diff(arrivals)) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError, match="arrival rate must be > 0"):
        poisson_arrivals(np.random.default_rng(0), 3, 0.0)


def test_prompt_lengths_count_the_history():
    t = small_trace()
    lengths, i = t.prompt_lengths(), 0
    for conv in t.conversations:
        expect = 24
        for k, user in enumerate(conv.turns):
            expect += len(user) + (5 if k else 0)
            assert lengths[i] == expect
            i += 1


def test_json_round_trip_and_workload_view():
    t = small_trace()
    doc = t.to_json()
    assert ChatTrace.from_json(doc) == t
    w = Workload.from_json(doc)  # what the worker reads: one request per turn
    assert len(w.requests) == t.num_requests and w.output_tokens == t.output_tokens
    assert w.num_adapters == 4
    turns = [u for c in t.conversations for u in c.turns]
    assert [r.prompt_ids for r in w.requests] == turns


def test_unshared_trace_matches_the_chat_lengths():
    t = small_trace()
    u = unshared_trace(t, 10, 5.0, VOCAB)
    assert u.num_requests == 10 and not u.system_prompts
    lengths = u.prompt_lengths()
    assert set(lengths) <= set(t.prompt_lengths())
    prompts = [c.turns[0] for c in u.conversations]
    assert len(set(prompts)) == 10  # nothing shared
    assert [c.adapter for c in u.conversations] == [i % 4 for i in range(10)]
    with pytest.raises(ValueError, match="num_requests must be in"):
        unshared_trace(t, 41, 5.0, VOCAB)


def test_first_conversations_keeps_the_earliest():
    t = small_trace()
    short = first_conversations(t, 3)
    assert short.conversations == t.conversations[:3]
    assert short.system_prompts == t.system_prompts


class FakeEngine:
    """One token per step for each running request (token ids from its id), finished at
    max_tokens; reports half its prompt as cached. Logs every submit and finish."""

    def __init__(self):
        self.running: dict[str, tuple[list[int], int, list[int]]] = {}
        self.log: list[tuple] = []

    def submit(self, rid, ids, max_tokens, adapter):
        self.running[rid] = (ids, max_tokens, [])
        self.log.append(("submit", rid, list(ids), adapter))

    def step(self):
        out = []
        for rid, (ids, max_tokens, tokens) in list(self.running.items()):
            tokens.append(5000 + 100 * int(rid) + len(tokens))
            done = len(tokens) == max_tokens
            out.append((rid, list(tokens), done, len(ids) // 2))
            if done:
                del self.running[rid]
                self.log.append(("finish", rid))
        return out

    def busy(self):
        return bool(self.running)


def test_drive_resends_the_history_with_the_engine_answers():
    t = small_trace(rate=1e6)  # every conversation starts at once
    engine = FakeEngine()
    seen = []
    progress = lambda done, total: seen.append((done, total))  # noqa: E731
    got = chat_loop.drive(t.to_json(), engine.submit, engine.step, engine.busy, progress)
    submits = {e[1]: (e[2], e[3]) for e in engine.log if e[0] == "submit"}
    assert len(submits) == t.num_requests
    i = 0
    for conv in t.conversations:
        history = list(t.system_prompts[conv.system])
        for k, user in enumerate(conv.turns):
            prompt, adapter = submits[str(i + k)]
            if k:  # the previous turn finished before this one was sent, its answer included
                prev = str(i + k - 1)
                assert engine.log.index(("finish", prev)) < _submit_index(engine.log, str(i + k))
                history += [5000 + 100 * (i + k - 1) + j for j in range(t.max_tokens)]
            history += list(user)
            assert prompt == history and adapter == conv.adapter
        i += len(conv.turns)
    assert got["prompt_tokens"] == t.prompt_lengths()
    assert got["cached_tokens"] == [n // 2 for n in t.prompt_lengths()]
    assert all(len(s) == t.max_tokens for s in got["token_s"])
    assert all(s[0] >= sent for s, sent in zip(got["token_s"], got["sent_s"]))
    assert seen == [(i + 1, t.num_requests) for i in range(t.num_requests)]


def _submit_index(log: list[tuple], rid: str) -> int:
    return next(j for j, e in enumerate(log) if e[0] == "submit" and e[1] == rid)


def test_cache_stats_hit_rate():
    got = {"prompt_tokens": [100, 300], "cached_tokens": [0, 200]}
    assert chat_loop.cache_stats(got) == {
        "prompt_tokens": 400,
        "cached_tokens": 200,
        "hit_rate": 0.5,
    }
    assert chat_loop.cache_stats({"prompt_tokens": [], "cached_tokens": []})["hit_rate"] == 0.0


def _row(label: str, tok_s: float, ttft: float, cpu: float | None = None) -> dict:
    return {
        "experiment": "prefix",
        "label": label,
        "workload": "w",
        "output_tok_s": tok_s,
        "output_tok_per_cpu_s": cpu if cpu is not None else tok_s / 2,
        "ttft_p50_ms": ttft,
        "extra": {"hit_rate": 0.5},
    }


def test_targets_ratios_and_verdicts():
    rows = [
        _row("ort-lora int4 caching on", 300.0, 100.0),
        _row("ort-lora int4 caching off", 100.0, 1000.0),
        _row("ort-lora float32 caching on", 150.0, 200.0),
        _row("ort-lora float32 caching off", 100.0, 500.0),
        _row("short trace: ort-lora float32 caching on", 90.0, 50.0),
        _row("short trace: vLLM float32 prefix caching", 10.0, 900.0),
        _row("unshared: ort-lora int4 caching on", 95.0, 10.0),
        _row("unshared: ort-lora int4 caching on", 99.0, 10.0),  # the faster run counts
        _row("unshared: ort-lora int4 caching off", 100.0, 10.0),
        {"experiment": "systems/x", "label": "ort-lora int4 caching on", "output_tok_s": 1.0},
    ]
    got = {what: (wall, cpu, goal) for what, wall, cpu, goal in prefix_report.targets(rows)}
    assert got["prefix int4: TTFT p50 caching off / on"] == (10.0, None, 5.0)
    assert got["prefix int4: out tok/s caching on / off"] == (3.0, 3.0, 2.0)
    assert got["prefix float32: TTFT p50 caching off / on"][0] == 2.5
    assert got["prefix float32: out tok/s caching on / off"][0] == 1.5
    vllm = got["prefix float32: ort-lora caching on / vLLM prefix caching (short trace)"]
    assert vllm == (9.0, 9.0, 3.0)
    assert got["prefix unshared int4: out tok/s caching on / off"][0] == pytest.approx(0.99)
    verdicts = [prefix_report.verdict(w, g) for w, _, g in got.values()]
    assert verdicts == ["PASS", "PASS", "MISS", "MISS", "PASS", "PASS"]
    text = prefix_report.summary(rows)
    assert "| ort-lora int4 caching on | w |" in text and "50.0%" in text and "MISS" in text


def test_targets_with_a_failed_row():
    rows = [
        _row("ort-lora int4 caching on", 300.0, 100.0),
        {**_row("ort-lora int4 caching off", 0, 0), "error": "boom"},
    ]
    got = {what: wall for what, wall, _, _ in prefix_report.targets(rows)}
    assert got["prefix int4: out tok/s caching on / off"] is None
    assert prefix_report.verdict(None, 2.0) == "-"
    assert "error: boom" in prefix_report.table(rows)
    assert prefix_report.targets([]) == []


def test_plan_rows_and_labels():
    runs = plan.prefix_runs(plan.QUICK, 256, {"ort-lora", "vllm"})
    labels = [r["label"] for r in runs]
    rows = (*plan.PREFIX_ROWS, *plan.PREFIX_VLLM_ROWS, *plan.PREFIX_UNSHARED_ROWS)
    assert sorted(labels) == sorted(label for _, label, _, _ in rows)
    assert all(r["experiment"] == "prefix" for r in runs)
    for r in runs:
        assert r["options"]["prefix_caching"] == ("off" not in r["label"]), r["label"]
    caching = [r["options"]["prefix_caching"] for r in runs if r["label"].startswith("ort-lora")]
    assert caching == [True, False, True, False]  # on and off alternate
    chat = runs[0]["workload"]
    assert chat.num_requests == plan.QUICK.prefix["requests"]
    short = next(r["workload"] for r in runs if r["system"] == "vllm")
    assert len(short.conversations) == plan.QUICK.prefix["vllm_conversations"]
    targets_rows = {
        prefix_report.VLLM_OURS,
        prefix_report.VLLM,
        prefix_report.UNSHARED.format("on"),
        prefix_report.UNSHARED.format("off"),
    }
    assert targets_rows <= set(labels)
    assert [r["system"] for r in plan.prefix_runs(plan.QUICK, 256, {"ort-lora"})] == [
        "ort-lora"
    ] * (len(runs) - 1)


def test_prefix_alone_runs_only_its_systems():
    everything = ["ort-lora", "vllm", "transformers", "genai"]
    assert systems_for(["prefix"], everything) == ["ort-lora", "vllm"]
    assert systems_for(["prefix", "quant"], everything) == everything
    assert "prefix" in plan.OPT_IN_EXPERIMENTS and "prefix" in plan.EXPERIMENTS
