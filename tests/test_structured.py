"""Structured outputs and logit_bias in the engine, on the tiny random Llama (its byte-level
tokenizer spells anything): every constrained output is valid for its grammar, each row of a
mixed batch keeps its own constraint and adapter, and a constrained request in a batch equals
the same request alone. Oracles: jsonschema, Python's re, the choice list; the unconstrained
engine for what logit_bias moves."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.errors import RequestError
from ort_lora.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputs(json=SCHEMA),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutputs(choice=["yes", "no", "maybe not"]),
    "grammar": StructuredOutputs(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'),
}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in {"yes", "no", "maybe not"}
    return re.fullmatch(r"\((\d{1,2})(,\d{1,2})*\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_llama_export):
    return LLM(tiny_llama_export, num_pages=256, max_model_len=256)


def params(spec, seed: int, **kw) -> SamplingParams:
    kw = {"temperature": 1.0, "seed": seed, "max_tokens": 200} | kw
    return SamplingParams(structured_outputs=spec, **kw)


def closing_bias(llm, chars: str = '"}') -> dict[int, float]:
    """Favours closing characters: a free JSON object from random weights would otherwise run
    on inside a string far past any max_tokens (logit_bias and the grammar combine)."""
    tok = llm.get_tokenizer()
    return {tok.encode(c, add_special_tokens=False)[0]: 6.0 for c in chars}


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_sampled_output_is_valid(llm, kind, seed):
    """Eight sampled outputs per grammar (random weights: the grammar alone makes them
    valid), each finished by its grammar's end, never by length."""
    prompts = [{"prompt_token_ids": [5 + i, 17, 99]} for i in range(8)]
    bias = closing_bias(llm) if kind == "json_object" else None
    outs = llm.generate(prompts, [params(SPECS[kind], seed + i, logit_bias=bias) for i in range(8)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None, c
        assert valid(kind, c.text), c.text


def test_mixed_batch_rows_keep_their_own_constraints(llm, tiny_qv_adapter):
    """Every kind, unconstrained rows, greedy and sampled rows, base and adapter rows in one
    batch: each row equals the same request run alone."""
    lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
    reqs = [(SPECS[k], 0.0 if i % 2 else 1.0) for i, k in enumerate([*SPECS, *SPECS])]
    reqs += [(None, 0.0), (None, 1.0)]
    prompts = [{"prompt_token_ids": [9, 8, 7 + i]} for i in range(len(reqs))]
    ps = [params(spec, 40 + i, temperature=t, max_tokens=40) for i, (spec, t) in enumerate(reqs)]
    loras = [lora if i % 3 else None for i in range(len(reqs))]
    mixed = llm.generate(prompts, ps, lora_request=loras)
    for prompt, p, lr, out in zip(prompts, ps, loras, mixed):
        alone = llm.generate(prompt, p, lora_request=lr)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_grammar_constrains_logits_not_logprobs(llm):
    """Logprobs stay the raw model's (vLLM's default), the token is the grammar's."""
    spec = StructuredOutputs(choice=["zz"])
    p = SamplingParams(temperature=0, max_tokens=5, logprobs=1, structured_outputs=spec)
    out = llm.generate({"prompt_token_ids": [5, 6]}, p)[0].outputs[0]
    free = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=1,
                                                                     logprobs=1))[0]  # fmt: skip
    assert out.text == "zz"
    first = out.logprobs[0]
    assert first[out.token_ids[0]].rank > 1  # not what the model would have picked
    np.testing.assert_allclose(
        first[out.token_ids[0]].logprob,
        free.outputs[0].logprobs[0].get(out.token_ids[0], first[out.token_ids[0]]).logprob,
    )


def test_logit_bias_moves_the_choice(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = llm.generate({"prompt_token_ids": [5]}, greedy)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            logit_bias={base[0]: -100.0, 77: 100.0})  # fmt: skip
    out = llm.generate({"prompt_token_ids": [5]}, banned)[0].outputs[0].token_ids
    assert base[0] not in out and out == [77] * 4


@pytest.mark.parametrize(
    "spec, bias, message",
    [
        (StructuredOutputs(regex="(a"), None, "unclosed group"),
        (StructuredOutputs(json={"type": "bogus"}), None, "bogus"),
        (StructuredOutputs(grammar="start: nothing_defined"), None, "nothing_defined"),
        (None, {300: 1.0}, r"logit_bias token ids \[300\] are outside the vocabulary"),
    ],
)
def test_bad_constraints_are_refused_by_name(llm, spec, bias, message):
    p = SamplingParams(max_tokens=4, structured_outputs=spec, logit_bias=bias)
    with pytest.raises(RequestError, match=message) as info:
        llm.generate({"prompt_token_ids": [5]}, p)
    assert info.value.param in ("structured_outputs", "logit_bias")
    assert not llm.engine.has_unfinished_requests()


def test_spec_needs_exactly_one_kind():
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(RequestError, match="logit_bias must be in"):
        SamplingParams(logit_bias={5: 101})


def test_listed_properties_close_an_object(llm, seed):
    """As vLLM's default engine: an object schema that lists properties and says nothing of
    others admits only those; additionalProperties, where given, is kept."""
    listed = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
              "required": ["a"]}  # fmt: skip
    prompts = [{"prompt_token_ids": [7 + i, 3]} for i in range(8)]
    outs = llm.generate(prompts, [params(StructuredOutputs(json=listed), seed + i)
                                  for i in range(8)])  # fmt: skip
    assert all(json.loads(o.outputs[0].text).keys() == {"a"} for o in outs)
    opened = listed | {"additionalProperties": {"type": "integer", "maximum": 9}}
    bias = closing_bias(llm, '"')
    spec = StructuredOutputs(json=opened)
    outs = llm.generate(prompts, [params(spec, seed + i, logit_bias=bias) for i in range(8)])
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert any(len(json.loads(t)) > 1 for t in finished), finished


def test_a_served_request_compiles_its_grammar_once(tiny_llama_export, monkeypatch):
    """AsyncEngine compiles on a worker thread and hands the grammar to the engine, whose
    thread compiles nothing; a compile error names the request field it came from."""
    import asyncio

    from ort_lora.engine.async_engine import AsyncEngine
    from ort_lora.engine.grammar import Grammars

    calls = []
    compile_ = Grammars.compile
    monkeypatch.setattr(Grammars, "compile", lambda self, spec: calls.append(spec) or
                        compile_(self, spec))  # fmt: skip
    spec = StructuredOutputs(json=SCHEMA, source="response_format")
    bad = StructuredOutputs(regex="(", source="guided_regex")

    async def run():
        engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=64)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=4, structured_outputs=spec)
            outs = [o async for o in engine.generate([5, 6, 7], params)]
            with pytest.raises(RequestError, match="guided_regex") as info:
                params = SamplingParams(max_tokens=4, structured_outputs=bad)
                [o async for o in engine.generate([5, 6, 7], params)]
            return outs, info.value.param
        finally:
            await engine.stop()

    outs, param = asyncio.run(run())
    assert outs[-1].finished and calls == [spec, bad] and param == "guided_regex"
