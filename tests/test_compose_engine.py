"""Composed requests through the engine: the scheduler's bookkeeping (every composed adapter
pinned, counted against max_loras, one segment per composition), LLM.generate against PEFT,
and the refusals.

Oracle: PEFT's add_weighted_adapter(..., combination_type="cat") on the tiny random Llama,
which builds the exact weighted sum of the adapters' deltas. One generate() call mixes composed
requests (0.7 one + 0.3 two; 1.5 two - 0.5 one; one at 0.5), single-adapter requests (a plain
and a DoRA adapter) and base requests: prompt logprobs within 1e-4 of PEFT's teacher-forced
log-softmax, greedy tokens equal PEFT's generate, and every request's output equals that
request run alone.
"""

from __future__ import annotations

import copy

import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.adapters import AdapterNotFoundError, CompositionError
from ort_lora.config import EngineConfig
from ort_lora.engine import PagePool, Scheduler, Sequence, build_metadata
from ort_lora.engine.invariants import assert_invariants
from ort_lora.export.tiny import save_random_adapters

# --- the scheduler alone ----------------------------------------------------------------------


def _scheduler(max_loras: int, num_pages: int = 64) -> Scheduler:
    config = EngineConfig(
        num_pages=num_pages, max_num_batched_tokens=64, max_num_seqs=8, block_size=4,
        max_loras=max_loras,
    )  # fmt: skip
    return Scheduler(config, PagePool(num_pages))


def _seq(cid, adapter=None, composition=()):
    return Sequence(cid, [1, 2, 3, 4, 5], 2, adapter, 2 if adapter else 0, None, False, composition)


def _run(sched, steps=1):
    plans = []
    for _ in range(steps):
        plan = sched.schedule()
        sched.on_step_done(plan, {e.completion_id: 7 for e in plan.entries if e.sample})
        assert_invariants(sched.pool, None, sched)
        plans.append(plan)
    return plans


def test_a_composed_sequence_pins_every_adapter_and_gets_one_segment():
    sched = _scheduler(max_loras=3)
    sched.add(_seq("comp", composition=[("a", 2, 0.7), ("b", 3, 0.3)]))
    sched.add(_seq("single", "a"))
    sched.add(_seq("base"))
    sched.add(_seq("comp2", composition=[("b", 3, 0.7), ("a", 2, 0.3)]))
    plan = sched.schedule()
    assert {a.adapter_id: len(a.pages) for a in plan.adapters} == {"a": 2, "b": 3}
    assert sched.pool.refcount("a") == 3 and sched.pool.refcount("b") == 2
    slot = {a.adapter_id: a.slot for a in plan.adapters}
    order = [e.completion_id for e in plan.entries]
    assert order == ["base", "single", "comp", "comp2"]  # base, slots, compositions
    assert plan.has_composition
    assert plan.segments == [
        [], [(slot["a"], 1.0)], [(slot["a"], 0.7), (slot["b"], 0.3)],
        [(slot["b"], 0.7), (slot["a"], 0.3)],
    ]  # fmt: skip
    meta = build_metadata(plan, 4)
    assert meta["lora_seg_starts"].tolist() == [0, 5, 10, 15, 20]
    assert meta["lora_seg_slots"].tolist() == [-1, slot["a"], -1, -1]
    sched.on_step_done(plan, {e.completion_id: 7 for e in plan.entries if e.sample})
    assert_invariants(sched.pool, None, sched)
    _run(sched, 2)
    assert not sched.has_unfinished()
    assert sched.pool.refcount("a") == 0 and sched.pool.refcount("b") == 0


def test_composed_sequences_count_every_adapter_against_max_loras():
    """max_loras 2: while a+b runs, c waits and a (active) runs; c runs once a+b is done."""
    sched = _scheduler(max_loras=2)
    sched.add(_seq("ab", composition=[("a", 2, 0.5), ("b", 2, 0.5)]))
    sched.add(_seq("c", "c"))
    sched.add(_seq("a", "a"))
    first = sched.schedule()
    assert {e.completion_id for e in first.entries} == {"ab", "a"}
    assert sched.stats().active_adapters == 2
    sched.on_step_done(first, {e.completion_id: 7 for e in first.entries if e.sample})
    plans = _run(sched, 4)
    ran_c = [i for i, p in enumerate(plans) if any(e.completion_id == "c" for e in p.entries)]
    ran_ab = [i for i, p in enumerate(plans) if any(e.completion_id == "ab" for e in p.entries)]
    assert ran_c and min(ran_c) > max(ran_ab)
    assert not sched.has_unfinished()


def test_a_composition_is_admitted_when_all_its_adapters_fit_the_pool():
    """12 pages: a (resident, idle: 2) + b (8) + 2 KV blocks. The composition keeps a, loads b
    in free pages and evicts nothing it needs; with too few pages it waits."""
    sched = _scheduler(max_loras=4, num_pages=12)
    sched.add(_seq("a", "a"))
    _run(sched, 2)  # a is resident and idle now
    assert sched.pool.is_resident("a") and sched.pool.refcount("a") == 0
    sched.add(_seq("ab", composition=[("b", 8, 0.5), ("a", 2, 0.5)]))
    plan = sched.schedule()
    assert [e.completion_id for e in plan.entries] == ["ab"]
    assert [a.adapter_id for a in plan.loads] == ["b"]  # a was a hit
    assert not sched.pool.can_admit_all(2, [("c", 1)])  # pinned adapters are not evictable


@pytest.mark.parametrize("seed", range(4))
def test_composed_single_and_base_sequences_under_preemption_keep_the_books(seed):
    """A pool too small for everything: random composed, single and base sequences arrive,
    are preempted and recomputed; the invariants hold after every step (pins = running
    sequences per adapter, pages partitioned) and all finish with every pin released."""
    import random

    rng = random.Random(seed)
    sched = _scheduler(max_loras=3, num_pages=16)
    pages = {a: rng.randint(1, 3) for a in "abcde"}
    for i in range(24):
        kind = rng.random()
        prompt = [rng.randrange(1, 90) for _ in range(rng.randint(2, 12))]
        if kind < 0.4:
            names = rng.sample("abcde", rng.randint(2, 3))
            comp = [(a, pages[a], rng.uniform(-1, 1)) for a in names]
            seq = Sequence(f"c{i}", prompt, rng.randint(4, 16), None, 0, None, False, comp)
        elif kind < 0.8:
            a = rng.choice("abcde")
            seq = Sequence(f"s{i}", prompt, rng.randint(4, 16), a, pages[a])
        else:
            seq = Sequence(f"b{i}", prompt, rng.randint(4, 16))
        sched.add(seq)
        if rng.random() < 0.5:
            _run(sched)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        _run(sched)
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert all(refs == 0 for _, refs in sched.pool.residents().values())


# --- LLM.generate against PEFT ----------------------------------------------------------------

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from peft_cases import COMPOSE_ADAPTERS, assert_output_matches_peft  # noqa: E402
from test_engine_peft import MAX_NEW, PROMPTS  # noqa: E402

PEFT_ADAPTERS = COMPOSE_ADAPTERS
# the terms of each kind of request: (adapter, weight); () = base
KINDS = [
    (("one", 0.7), ("two", 0.3)),
    (("one", 1.0),),
    (),
    (("two", 1.5), ("one", -0.5)),
    (("dora", 1.0),),
    (("one", 0.5),),
]


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    return save_random_adapters(
        hf_model, tmp_path_factory.mktemp("compose_engine"), PEFT_ADAPTERS, 700
    )


def lora_request(terms, dirs):
    """None (base), one LoRARequest (weight 1), or the list of a composition."""
    ids = {name: i + 1 for i, name in enumerate(PEFT_ADAPTERS)}
    loras = [LoRARequest(n, ids[n], str(dirs[n]), weight=w) for n, w in terms]
    if not loras:
        return None
    return loras[0] if len(terms) == 1 and terms[0][1] == 1.0 else loras


def peft_model(hf_model, dirs, terms):
    """The base, one adapter, or add_weighted_adapter(cat) of the terms, in eval mode."""
    model = copy.deepcopy(hf_model)
    if not terms:
        return model
    names = [n for n, _ in terms]
    model = peft.PeftModel.from_pretrained(model, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    if len(terms) > 1 or terms[0][1] != 1.0:
        model.add_weighted_adapter(names, [w for _, w in terms], "mix", combination_type="cat")
        model.set_adapter("mix")
    return model.eval()


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=3, ignore_eos=True)


def _prompt_lps(out) -> list[dict]:
    return [{t: lp.logprob for t, lp in e.items()} for e in out.prompt_logprobs[1:]]


def test_composed_single_dora_and_base_requests_match_peft_and_run_alone(
    tiny_llama_export, hf_model, adapter_dirs
):
    requests = [(p, KINDS[i % len(KINDS)]) for i, p in enumerate(PROMPTS * 2)]
    llm = LLM(tiny_llama_export, num_pages=256, max_loras=4)
    loras = [lora_request(terms, adapter_dirs) for _, terms in requests]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], PARAMS, loras)
    models, worst = {}, 0.0
    for (prompt, terms), out, lora in zip(requests, outs, loras, strict=True):
        if terms not in models:
            models[terms] = peft_model(hf_model, adapter_dirs, terms)
        worst = max(worst, assert_output_matches_peft(models[terms], prompt, out, terms))
        alone = llm.generate([{"prompt_token_ids": prompt}], PARAMS, [lora])[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, f"{terms} alone"
        for mixed, single in zip(_prompt_lps(out), _prompt_lps(alone), strict=True):
            assert mixed.keys() == single.keys(), f"{terms} alone: other top tokens"
            for t in mixed:
                assert abs(mixed[t] - single[t]) < 1e-5, f"{terms} alone: logprob of {t}"
    composed = outs[0].lora_request
    assert [(r.lora_name, r.weight) for r in composed] == [("one", 0.7), ("two", 0.3)]
    counts = llm.engine.registry.request_counts  # composed requests count for each adapter
    for aid, name in enumerate(PEFT_ADAPTERS, start=1):
        uses = sum(name in dict(terms) for _, terms in requests)
        assert counts[aid] == 2 * uses, f"{name}: {counts[aid]} requests counted, not {2 * uses}"
    print(f"largest |prompt logprob - PEFT|: {worst:.2e}")


@pytest.mark.parametrize(
    "terms, error, message",
    [
        ([], CompositionError, "a composition names no adapter"),
        ([("one", 0.5), ("two", 0.5), ("dora", 0.1)], CompositionError,
         r"a composition of 3 adapters \(one, two, dora\) exceeds max_loras = 2"),
        ([("one", 0.5), ("dora", 0.5)], CompositionError,
         "'dora' is a DoRA adapter: DoRA adapters cannot be composed"),
        ([("dora", 0.5)], CompositionError, "'dora' is a DoRA adapter"),
        ([("one", 0.5), ("one", 0.5)], CompositionError, "'one' appears twice"),
    ],
)  # fmt: skip
def test_bad_compositions_are_refused_and_the_engine_serves_on(
    tiny_llama_export, adapter_dirs, terms, error, message
):
    llm = LLM(tiny_llama_export, num_pages=128, max_loras=2)
    loras = [LoRARequest(n, i + 1, str(adapter_dirs[n])) for i, n in enumerate(PEFT_ADAPTERS)]
    by_name = {r.lora_name: r for r in loras}
    asked = [LoRARequest(n, by_name[n].lora_int_id, by_name[n].lora_path, w) for n, w in terms]
    with pytest.raises(error, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, [asked])
    good = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, PARAMS, [None, loras[:2]])
    assert all(o.finished and len(o.outputs[0].token_ids) == MAX_NEW for o in good)
    assert not llm.engine.has_unfinished_requests()


def test_non_finite_weights_and_unknown_adapters_are_refused_by_name(
    tiny_llama_export, adapter_dirs
):
    for weight in (float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="adapter 'one': weight must be a finite number"):
            LoRARequest("one", 1, str(adapter_dirs["one"]), weight)
    llm = LLM(tiny_llama_export, num_pages=128, max_loras=2)
    one = LoRARequest("one", 1, str(adapter_dirs["one"]))
    llm.engine.add_lora(one)
    nope = LoRARequest("nope", 9, str(adapter_dirs["two"]), 0.5)
    with pytest.raises(AdapterNotFoundError, match="adapter not found: 'nope'"):
        llm.engine.add_request("r", PROMPTS[0], PARAMS, [one, nope], register=False)
    with pytest.raises(CompositionError, match="lists LoRARequests, got 'one'"):
        llm.engine.add_request("r", PROMPTS[0], PARAMS, ["one"])
    assert not llm.engine.has_unfinished_requests()
