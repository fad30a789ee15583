"""Fault isolation of a failed model step (engine/isolation.py, LLMEngine._isolate).

Layers: sub_plan and isolate against a fake model whose logits name their entry and row (no
model); then the engine on the tiny random Llama with a runner that raises, like a kernel,
for any run holding a marked completion: only that request fails, every other request's
greedy output equals its output without it; requests at fault never stop the engine, a
broken model still does.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora import LoRARequest, SamplingParams
from ort_lora.engine.isolation import isolate, probe
from ort_lora.engine.llm_engine import MAX_STEP_FAILURES, LLMEngine
from ort_lora.engine.pool import PagePool
from ort_lora.engine.step_plan import BASE_SLOT, ScheduledSeq, StepAdapter, make_plan, sub_plan
from ort_lora.errors import EngineError

# --- sub-plans and bisection against a fake model --------------------------------------------


def _entry(cid: str, slot=BASE_SLOT, rows=(0,), terms=()) -> ScheduledSeq:
    return ScheduledSeq(cid, (1, 2, 3), 0, (0,), slot, rows, True, len(rows) - 1, 0, terms)


def _plan():
    """Base, adapter slots 0 and 1, a composition of both; some with prompt-logprob rows."""
    entries = [
        _entry("b0"), _entry("b1", rows=(0, 1, 2)), _entry("a0", 0), _entry("a1", 0, (1, 2)),
        _entry("x0", 1), _entry("c0", terms=((0, 0.5), (1, 0.5))), _entry("c1", terms=((1, 2.0),)),
    ]  # fmt: skip
    adapters = [StepAdapter(0, "a", (5, 6), True), StepAdapter(1, "x", (7,), False)]
    return make_plan(entries, adapters, preempted=["gone"])


def _fake_run(bad: set[str], calls: list):
    """A model whose logits row k is [entry number, logit row offset]; raises for `bad`."""

    def run(plan):
        calls.append([e.completion_id for e in plan.entries])
        if bad & {e.completion_id for e in plan.entries}:
            raise RuntimeError("injected: a kernel found a non-finite weight")
        return np.array([[hash(e.completion_id) % 997, r] for e in plan.entries
                         for r in e.logit_rows], np.float64)  # fmt: skip

    return run


def test_a_sub_plan_renumbers_its_adapters_and_offsets():
    plan = _plan()
    sub = sub_plan(plan, [e for e in plan.entries if e.completion_id in {"b1", "x0", "c1"}])
    assert [e.completion_id for e in sub.entries] == ["b1", "x0", "c1"]
    assert [(a.slot, a.adapter_id, a.needs_load) for a in sub.adapters] == [(0, "x", False)]
    assert [e.slot for e in sub.entries] == [BASE_SLOT, 0, BASE_SLOT]
    assert sub.entries[2].terms == ((0, 2.0),) and sub.segments == [[], [(0, 1.0)], [(0, 2.0)]]
    assert [e.logits_offset for e in sub.entries] == [0, 3, 4] and sub.num_logit_rows == 5
    assert not sub.loads and not sub.preempted and not sub.prefetch


@pytest.mark.parametrize("bad", [set(), {"a1"}, {"b0", "c1"}, {"b0", "b1", "a0", "a1", "x0"}])
def test_isolate_fails_exactly_the_entries_that_fail_alone(bad):
    plan, calls = _plan(), []
    found = isolate(_fake_run(bad, calls), plan, RuntimeError("the step failed"))
    assert set(found.failed) == bad
    assert all([cid] in calls for cid in bad)  # each failed in a run of its own
    survivors = found.survivors(lambda cid: cid != "c0")  # c0: a sibling of a failed entry
    good = [e for e in plan.entries if e.completion_id not in bad | {"c0"}]
    want = _fake_run(set(), [])(sub_plan(plan, good))
    assert [e.completion_id for e in survivors[0].entries] == [e.completion_id for e in good]
    np.testing.assert_array_equal(survivors[1], want)  # each entry's rows, at its new offset
    assert found.num_runs == len(calls) <= 2 * len(plan.entries) - 2


def test_a_step_of_one_entry_is_run_once_more():
    plan, calls = make_plan([_entry("b0")], []), []
    found = isolate(_fake_run(set(), calls), plan, RuntimeError("a transient fault"))
    assert not found.failed and calls == [["b0"]]
    found = isolate(_fake_run({"b0"}, calls), plan, RuntimeError("a bad row"))
    assert list(found.failed) == ["b0"] and "bad" not in str(found.failed["b0"])
    assert found.num_runs == 1 and not found.pieces


def test_when_every_entry_fails_nothing_survives():
    plan, calls = _plan(), []
    found = isolate(_fake_run({e.completion_id for e in plan.entries}, calls), plan, ValueError())
    assert set(found.failed) == {e.completion_id for e in plan.entries} and not found.pieces
    assert found.survivors(lambda cid: True) is None


def test_the_probe_runs_one_base_token_in_a_free_page_and_gives_it_back():
    pool, plans = PagePool(4), []
    pool.acquire_adapter("idle", 3)
    pool.release_adapter("idle")
    assert probe(plans.append, pool, block_size=8) is None
    assert [(e.token_ids, e.start_pos, e.slot) for e in plans[0].entries] == [((0,), 0, -1)]
    assert plans[0].entries[0].block_table == (3,) and not plans[0].adapters
    assert pool.num_free == 1 and pool.is_resident("idle")  # given back, nothing evicted

    def broken(plan):
        raise RuntimeError("injected: the device is gone")

    assert "device is gone" in str(probe(broken, pool, block_size=8))
    assert pool.num_free == 1 and not pool.kv_pages()
    pool.allocate_kv(1)
    assert "no free page" in str(probe(plans.append, pool, block_size=8)) and len(plans) == 1


# --- the engine on the tiny model ------------------------------------------------------------

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG_PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1] + list(range(11, 32))  # 30 tokens


@pytest.fixture()
def make_engine(tiny_llama_export, tiny_qv_adapter):
    def make() -> LLMEngine:
        engine = LLMEngine(tiny_llama_export, num_pages=64, max_model_len=64, max_num_seqs=8,
                           max_num_batched_tokens=32)  # fmt: skip
        engine.add_lora(LoRARequest("qv", 1, str(tiny_qv_adapter)))
        return engine

    return make


def _requests(adapter: str):
    qv = LoRARequest("qv", 1, adapter)
    return {  # request id: (prompt, params, adapter); greedy, base and adapters
        "base": ([5, 17, 99, 3, 42], SamplingParams(**GREEDY), None),
        "qv": ([7, 7, 1, 200], SamplingParams(**GREEDY), qv),
        "comp": ([3, 1, 4, 1, 5], SamplingParams(**GREEDY), [LoRARequest("qv", 1, adapter, 0.5)]),
        "n2": ([8, 6, 4], SamplingParams(**GREEDY, n=2), None),
        "lp": (LONG_PROMPT, SamplingParams(**GREEDY, prompt_logprobs=2, logprobs=1), qv),
    }


def _poison(monkeypatch, engine: LLMEngine, marked: str) -> list:
    """Make every model run that holds completion `marked` raise, as a kernel would."""
    run, runs = engine.runner.run, []

    def faulty(plan, times=None):
        fails = any(e.completion_id == marked for e in plan.entries)
        runs.append((plan, fails))
        if fails:
            raise RuntimeError("injected: LoraSGMV found a non-finite weight")
        return run(plan, times)

    monkeypatch.setattr(engine.runner, "run", faulty)
    return runs


def _drive(engine: LLMEngine, requests: dict, late: dict | None = None, late_after: int = 0):
    """Run requests to the end (`late` ones added after `late_after` steps): (final outputs,
    failures) by request id."""
    for rid, (prompt, params, lora) in requests.items():
        engine.add_request(rid, prompt, params, lora)
    outputs, failures, steps = {}, {}, 0
    while engine.has_unfinished_requests() or (late and steps <= late_after):
        if late and steps == late_after:
            for rid, (prompt, params, lora) in late.items():
                engine.add_request(rid, prompt, params, lora)
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        failures |= dict(engine.take_failures())
        steps += 1
    return outputs, failures


def _same_output(got, want) -> None:
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    if want.prompt_logprobs is not None:
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert g.keys() == w.keys()
            assert [g[t].logprob for t in g] == pytest.approx([w[t].logprob for t in w], abs=1e-4)


@pytest.mark.parametrize("joins", ["the-first-prefills", "a-running-batch"])
def test_a_failing_row_fails_its_request_alone(make_engine, tiny_qv_adapter, monkeypatch, joins):
    """A request (n=2; its second completion makes the kernel raise) runs in a busy batch of
    base, adapter, composed, n=2 and prompt-logprob requests: in their first step (with the
    prompt-logprob request's first, mid-prompt chunk) or when they already decode. It alone
    fails, with an internal error; every other output equals its output without it."""
    requests = _requests(str(tiny_qv_adapter))
    want, failures = _drive(make_engine(), requests)
    assert not failures and set(want) == set(requests)
    engine = make_engine()
    runs = _poison(monkeypatch, engine, "bad#1")
    bad = {"bad": ([1, 2, 3, 4], SamplingParams(**GREEDY, n=2), requests["qv"][2])}
    if joins == "the-first-prefills":  # 28 tokens, then 4 of the 30-token prompt: 4 rows
        first, rest = list(requests.items())[:3], list(requests.items())[3:]
        got, failures = _drive(engine, dict(first) | bad | dict(rest))
    else:
        got, failures = _drive(engine, requests, bad, late_after=2)
    assert list(failures) == ["bad"] and isinstance(failures["bad"], EngineError)
    assert set(got) == set(requests)
    for rid in requests:
        _same_output(got[rid], want[rid])
    assert engine.healthy and engine.step_failures == 0
    failed_with = {e.completion_id: e for plan, fails in runs if fails for e in plan.entries}
    assert {"lp#0", "qv#0", "comp#0", "n2#0"} <= set(failed_with)  # a busy batch failed
    assert [[e.completion_id for e in p.entries] for p, fails in runs if fails][-1] == ["bad#1"]
    if joins == "the-first-prefills":
        assert failed_with["lp#0"].num_prompt_logit_rows == 4 and not failed_with["lp#0"].sample
    assert not engine.pool.kv_pages()


def test_requests_at_fault_never_stop_the_engine(make_engine, monkeypatch):
    """Bad requests one after another on an idle engine (each fails alone; the probe step
    runs): the engine stays healthy and then serves a request as before."""
    engine = make_engine()
    ok = {"ok": ([5, 17, 99], SamplingParams(**GREEDY), None)}
    want = _drive(engine, ok)[0]["ok"]
    _poison(monkeypatch, engine, "bad#0")
    for _ in range(MAX_STEP_FAILURES + 2):
        outputs, failures = _drive(engine, {"bad": ([4, 4, 4], SamplingParams(**GREEDY), None)})
        assert not outputs and isinstance(failures.get("bad"), EngineError)
        assert engine.healthy and engine.step_failures == 0
    outputs, failures = _drive(engine, ok)
    assert not failures
    _same_output(outputs["ok"], want)
    assert not engine.pool.kv_pages()  # the probe's page was given back


def test_a_broken_model_still_stops_the_engine(make_engine, monkeypatch):
    """Every run fails, the probe's too: each step counts; MAX_STEP_FAILURES make the engine
    unhealthy."""
    engine = make_engine()

    def broken(inputs, **kw):
        raise RuntimeError("injected: the device is gone")

    monkeypatch.setattr(engine.runner.session, "run", broken)
    for i in range(MAX_STEP_FAILURES):
        assert engine.healthy
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(**GREEDY, n=2), None)
        assert engine.step() == [] and not engine.has_unfinished_requests()
        assert [rid for rid, _ in engine.take_failures()] == [f"r{i}"]
        assert engine.step_failures == i + 1
    assert not engine.healthy
