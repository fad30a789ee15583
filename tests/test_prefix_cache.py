"""Prefix caching against the same engine with caching off: greedy ids and logprobs equal (to
the bit), for base, plain LoRA, DoRA and composed requests on float32 and int4 exports; prompts
that share no block, one, several, a partial block, or all of theirs; KV never crosses
adapter contents (two adapters on one prompt; an adapter reloaded under its name with new
weights) and is shared by identical contents under two names; preemption, eviction and
aborts under a small pool keep the books (the engine's invariants run after every step).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.export.tiny import save_random_adapters

pytest.importorskip("peft")

from peft_cases import COMPOSE_ADAPTERS  # noqa: E402

BS = 8  # the tiny exports' block size
_rng = np.random.default_rng(29)
SYSTEM = _rng.integers(1, 250, 29).tolist()  # 3 full blocks and 5 tokens
# second-round prompts after SYSTEM ran (its KV: 29 prompt + 5 output tokens, 4 full blocks)
# -> the prompt tokens expected from the cache
VARIANTS = {
    "several": (SYSTEM + [3, 1, 4, 1, 5, 9], 24),  # block 3 differs (outputs there before)
    "one": (SYSTEM[:8] + [7] * 9, 8),
    "partial": (SYSTEM[:12] + [2] * 6, 8),  # a partly equal block is never shared
    "none": ([SYSTEM[0] + 1] + SYSTEM[1:], 0),
    "all": (SYSTEM, 24),  # the block of the last token is always computed
    "aligned": (SYSTEM[:24], 16),  # ... even when it is full
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    return save_random_adapters(
        hf_model, tmp_path_factory.mktemp("prefix"), COMPOSE_ADAPTERS, seed=29
    )


def _identities(dirs) -> dict:
    one, two, dora = (LoRARequest(n, i + 1, str(dirs[n])) for i, n in enumerate(dirs))
    composed = [LoRARequest("one", 1, str(dirs["one"]), weight=0.7),
                LoRARequest("two", 2, str(dirs["two"]), weight=-0.4)]  # fmt: skip
    return {"base": None, "lora": one, "dora": dora, "composed": composed}


def _llm(model, caching: bool, **config) -> LLM:
    config = {"num_pages": 256, "max_loras": 4, **config}
    return LLM(model, enable_prefix_caching=caching, **config)


def _rounds(llm, identities: dict, rounds: list[list[list[int]]]):
    """Each round's prompts under every identity, one generate() per round; the outputs."""
    outs = []
    for prompts in rounds:
        requests = [(p, lora) for lora in identities.values() for p in prompts]
        outs += llm.generate([p for p, _ in requests], GREEDY, [lora for _, lora in requests])
    return outs


def assert_same_outputs(got, want) -> None:
    """Greedy ids equal and every returned logprob equal to the bit, request by request."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, g.request_id
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lg.keys() == lw.keys()
            diff = max(abs(lg[t].logprob - lw[t].logprob) for t in lg)
            assert diff == 0.0, f"{g.request_id}: logprobs differ by {diff}"


def test_shared_prefixes_are_reused_and_exact(tiny_llama_export, adapter_dirs):
    identities = _identities(adapter_dirs)
    rounds = [[SYSTEM], [p for p, _ in VARIANTS.values()]]
    on = _rounds(_llm(tiny_llama_export, True), identities, rounds)
    off = _rounds(_llm(tiny_llama_export, False), identities, rounds)
    assert_same_outputs(on, off)
    assert all(o.num_cached_tokens == 0 for o in off)
    cached = [o.num_cached_tokens for o in on[len(identities) :]]
    expected = [n for _ in identities for _, n in VARIANTS.values()]
    assert cached == expected


def test_int4_export_reuses_exactly(tiny_quant_export, adapter_dirs):
    model = tiny_quant_export("int4", 4)
    identities = {k: v for k, v in _identities(adapter_dirs).items() if k in ("base", "lora")}
    rounds = [[SYSTEM], [VARIANTS["several"][0], VARIANTS["all"][0]]]
    on = _rounds(_llm(model, True), identities, rounds)
    assert_same_outputs(on, _rounds(_llm(model, False), identities, rounds))
    assert [o.num_cached_tokens for o in on[2:]] == [24, 24, 24, 24]


def test_two_adapters_on_one_prompt_never_share(tiny_llama_export, adapter_dirs):
    ids = _identities(adapter_dirs)
    order = [ids["lora"], None, [ids["composed"][1]], ids["dora"], ids["composed"]]
    on, off = _llm(tiny_llama_export, True), _llm(tiny_llama_export, False)
    for lora in order:  # one after another: each finds the others' blocks in the cache
        got, want = on.generate([SYSTEM], GREEDY, [lora]), off.generate([SYSTEM], GREEDY, [lora])
        assert got[0].num_cached_tokens == 0, f"{lora} reused another adapter's KV"
        assert_same_outputs(got, want)
    assert on.generate([SYSTEM], GREEDY, ids["lora"])[0].num_cached_tokens == 24


def test_a_reloaded_name_with_new_weights_never_reuses(tiny_llama_export, adapter_dirs, tmp_path):
    path = tmp_path / "tenant"
    shutil.copytree(adapter_dirs["one"], path)
    lora = LoRARequest("tenant", 7, str(path))
    on = _llm(tiny_llama_export, True)
    on.generate([SYSTEM], GREEDY, lora)
    assert on.generate([SYSTEM], GREEDY, lora)[0].num_cached_tokens == 24
    before = on.engine.pool.stats().cached_pages
    on.engine.remove_lora("tenant")  # its cached blocks go with it
    assert on.engine.pool.stats().cached_pages < before
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # new weights, same place
        shutil.copy(adapter_dirs["two"] / name, path / name)
    got = on.generate([SYSTEM], GREEDY, lora)  # the same name, id and path
    assert got[0].num_cached_tokens == 0
    want = _llm(tiny_llama_export, False).generate([SYSTEM], GREEDY, lora)
    assert_same_outputs(got, want)


def test_a_reload_with_the_same_weights_reuses(tiny_llama_export, adapter_dirs):
    lora = LoRARequest("tenant", 7, str(adapter_dirs["one"]))
    on = _llm(tiny_llama_export, True)
    on.generate([SYSTEM], GREEDY, LoRARequest("other", 8, str(adapter_dirs["one"])))
    on.generate([SYSTEM], GREEDY, lora)
    on.engine.remove_lora("tenant")  # "other" keeps the blocks of the same content
    assert on.generate([SYSTEM], GREEDY, lora)[0].num_cached_tokens == 24


def test_identical_adapters_under_two_names_share(tiny_llama_export, adapter_dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(adapter_dirs["dora"], copy)
    first, second = LoRARequest("a", 1, str(adapter_dirs["dora"])), LoRARequest("b", 2, str(copy))
    on = _llm(tiny_llama_export, True)
    on.generate([SYSTEM], GREEDY, first)
    got = on.generate([SYSTEM], GREEDY, second)
    assert got[0].num_cached_tokens == 24
    assert_same_outputs(got, _llm(tiny_llama_export, False).generate([SYSTEM], GREEDY, second))


def test_prompt_logprobs_requests_skip_the_cache_and_stay_exact(tiny_llama_export):
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, logprobs=2)
    on, off = _llm(tiny_llama_export, True), _llm(tiny_llama_export, False)
    on.generate([SYSTEM], GREEDY)
    got, want = on.generate([SYSTEM], params), off.generate([SYSTEM], params)
    assert got[0].num_cached_tokens == 0
    assert_same_outputs(got, want)
    for g, w in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert max(abs(g[t].logprob - w[t].logprob) for t in g) < 1e-5


def test_small_pool_preemption_eviction_and_aborts(tiny_llama_export, adapter_dirs):
    """A pool too small for the load: cached blocks are evicted, sequences preempted and
    re-admitted (finding their own blocks), two requests aborted mid-way; every finished
    request equals the same request on a roomy engine without caching."""
    ids = _identities(adapter_dirs)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    loras = [ids["lora"], None, ids["dora"], ids["composed"]]
    requests = [(SYSTEM[: 16 + 3 * (i % 5)] + [i + 1] * (i % 3), loras[i % 4]) for i in range(12)]
    llm = _llm(tiny_llama_export, True, num_pages=40, max_num_batched_tokens=64)
    engine, done = llm.engine, {}
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(str(i), prompt, params, lora)
    steps = 0
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
        steps += 1
        if steps == 6:
            for rid in ("3", "8"):
                engine.abort_request(rid)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.stats().prefix_hits > 0
    finished = sorted((rid for rid in done if rid not in ("3", "8")), key=int)
    assert len(finished) == 10
    roomy = _llm(tiny_llama_export, False)
    want = roomy.generate([requests[int(r)][0] for r in finished], params,
                          [requests[int(r)][1] for r in finished])  # fmt: skip
    assert_same_outputs([done[r] for r in finished], want)
    stats = engine.pool.stats()
    assert stats.kv_pages == 0 and stats.cached_pages > 0
    assert stats.free_pages + stats.cached_pages + stats.adapter_pages_idle == stats.num_pages


def test_caching_off_takes_no_part(tiny_llama_export):
    off = _llm(tiny_llama_export, False)
    off.generate([SYSTEM, SYSTEM], GREEDY)
    stats = off.engine.pool.stats()
    assert stats.cached_pages == 0 and off.engine.scheduler.stats().prefix_queries == 0


def test_weights_changed_under_a_loaded_adapter_are_refused(tiny_llama_export, adapter_dirs,
                                                            tmp_path):  # fmt: skip
    """Its cached KV was computed with the weights it was loaded with: a re-read that finds
    other weights (same ranks and modules) fails by name instead of mixing the two."""
    from safetensors.numpy import load_file, save_file

    from ort_lora.adapters import AdapterError

    path = tmp_path / "t"
    shutil.copytree(adapter_dirs["one"], path)
    engine = _llm(tiny_llama_export, True).engine
    engine.add_lora(LoRARequest("t", 5, str(path)))
    engine.registry.get("t")  # read again from disk (no host cache on a CPU pool): unchanged
    weights = path / "adapter_model.safetensors"
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights)
    with pytest.raises(AdapterError, match="'t': its weights changed since it was registered"):
        engine.registry.get("t")
