"""The engine's request lifecycle on a tiny random model: refusals, abort, unload while
running, n > 1, seeds, stop rules, and the asyncio streaming interface."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from step_probes import slow_and_record_aborts

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.adapters import AdapterNotFoundError
from ort_lora.engine.async_engine import AsyncEngine
from ort_lora.errors import RequestError

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 42, 8, 77]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture()
def llm(tiny_llama_export):
    return LLM(tiny_llama_export, num_pages=64, max_model_len=64)


@pytest.mark.parametrize(
    "prompt, params, param, message",
    [
        (PROMPT, SamplingParams(max_tokens=60), "max_tokens", r"you requested 67 tokens \(7 in"),
        ([5] * 70, GREEDY, "prompt", "length is 64 tokens.*the prompt has 70 tokens"),
        ([5, 256], GREEDY, "prompt", r"ids \[256\] are outside the vocabulary \[0, 256\)"),
        ([], GREEDY, "prompt", "the prompt is empty"),
    ],
)
def test_requests_that_can_never_be_served(llm, prompt, params, param, message):
    """Checked once, at the engine's entry: RequestError naming the field (HTTP 400)."""
    prompt = prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
    with pytest.raises(RequestError, match=message) as info:
        llm.generate(prompt, params)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_context_follows_the_pool(tiny_llama_export, tiny_qv_adapter):
    """A pool must hold one request of max_model_len tokens: an explicit max_model_len that
    does not fit is refused at start, the model's own limit is lowered to the pool; then a
    request whose KV and adapter pages cannot fit together is refused by name."""
    with pytest.raises(ValueError, match="max_model_len 64 needs 8 KV pages of 8 tokens; the"):
        LLM(tiny_llama_export, num_pages=4, max_model_len=64)
    llm = LLM(tiny_llama_export, num_pages=4)  # 4 pages of 8 tokens
    assert llm.engine.max_model_len == 32
    lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
    with pytest.raises(RequestError, match=r"need 4 KV pages \+ 2 adapter pages, more than"):
        llm.generate(PROMPT, SamplingParams(max_tokens=25), lora_request=lora)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=25))[0].finished


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - 7
    assert out.outputs[0].finish_reason == "length"


def test_n_completions_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = llm.generate(PROMPT, params)[0]
    again = llm.generate(PROMPT, params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "n streams must differ"


def test_stop_token_ids_and_logprobs(llm):
    greedy = llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    stop_at = greedy[3]
    params = SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at], logprobs=2, ignore_eos=True
    )
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and lp[token].rank == 1  # greedy picks the most likely token
    np.testing.assert_allclose(
        out.cumulative_logprob,
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)),
        rtol=1e-5,
    )


def test_remove_lora_while_running_lets_it_finish(llm, tiny_qv_adapter):
    engine = llm.engine
    lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
    engine.add_request("r1", PROMPT["prompt_token_ids"], GREEDY, lora)
    engine.step()
    engine.remove_lora("qv")
    assert engine.list_loras() == []
    with pytest.raises(AdapterNotFoundError, match="being unloaded"):
        engine.add_request("r2", PROMPT["prompt_token_ids"], GREEDY, lora)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
    assert "qv" not in engine.registry and not engine.pool.is_resident(1)


def test_abort_frees_pages(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT["prompt_token_ids"], GREEDY)
    engine.step()
    assert engine.pool.stats().kv_pages > 0
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.pool.stats().kv_pages == 0 and not engine.has_unfinished_requests()


def test_async_stream_and_abort(tiny_llama_export):
    async def main():
        engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=64)
        await engine.start()
        try:
            outs = [o async for o in engine.generate(PROMPT["prompt_token_ids"], GREEDY)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 11))
            aborted = slow_and_record_aborts(engine.engine)
            long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            async for _ in engine.generate(PROMPT["prompt_token_ids"], long, request_id="x"):
                stats = engine.stats()  # a snapshot: it has seen the request running
                if stats["running"] == 1 and stats["pool"]["kv"] > 0:
                    break  # the client goes away: the request is aborted
            deadline = time.monotonic() + 10
            while engine.stats()["running"] or engine.stats()["pool"]["kv"]:
                assert time.monotonic() < deadline, f"pages not freed: {engine.stats()}"
                await asyncio.sleep(0.01)
            assert [out.outputs[0].finish_reason for out in aborted] == ["abort"]
            with pytest.raises(RequestError, match="maximum context length"):
                async for _ in engine.generate([5] * 10, SamplingParams(max_tokens=10**6)):
                    pass
        finally:
            await engine.stop()

    asyncio.run(main())


def test_chunked_prefill_equals_one_pass(tiny_llama_export):
    """A 37-token prompt in chunks of 8 (steps that return no logits row) == one pass."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    small = LLM(tiny_llama_export, num_pages=64, max_num_seqs=4, max_num_batched_tokens=8)
    chunked = small.generate(prompt, params)[0]
    whole = LLM(tiny_llama_export, num_pages=64).generate(prompt, params)[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    assert len(chunked.prompt_logprobs) == 37
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        np.testing.assert_allclose(
            [v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-5
        )
