"""What real clients send, through a live server over the tiny random Llama and one adapter:
echo with logprobs and max_tokens 0 (lm-eval's loglikelihood requests), prompt_logprobs,
response_format and vLLM's guided fields, tools, logit_bias, /tokenize, /detokenize, /version.
Oracles: the engine's own prompt_logprobs run directly (the HTTP layer must only reshape them;
the engine's are checked against transformers + PEFT in test_engine_peft.py), jsonschema and
Python's re for constrained outputs, the tokenizer for texts."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app

PROMPT_IDS = [5, 17, 99, 3, 42, 8, 77, 120]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama_export, tiny_qv_adapter):
    """(url, engine) with adapter "qv"; requests may bring a chat template."""
    from ort_lora.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=256, max_model_len=256)
    engine.add_lora(LoRARequest("qv", 1, str(tiny_qv_adapter)))
    with ServerThread(create_app(engine, trust_request_chat_template=True)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct(tiny_llama_export, tiny_qv_adapter):
    """direct(prompt ids, adapter or None) -> the engine's prompt_logprobs, run in-process."""
    llm = LLM(tiny_llama_export, num_pages=64, max_model_len=256)
    lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def run(ids: list[int], adapter: str | None):
        out = llm.generate({"prompt_token_ids": ids}, params, lora_request=adapter and lora)
        return [None if e is None else e[t].logprob for e, t in zip(out[0].prompt_logprobs, ids)]

    return run


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, timeout=60)


def favour(server, chars: str) -> dict[str, float]:
    """logit_bias that favours closing characters: random weights would otherwise run on
    (one more array item, one more string character) far past any max_tokens."""
    tok = server[1].tokenizer
    return {str(tok.encode(c, add_special_tokens=False)[0]): 6.0 for c in chars}


def chat(client, **kw):
    messages = [{"role": "user", "content": "hi"}]
    return client.chat.completions.create(model=kw.pop("model", "qv"), messages=messages, **kw)


@pytest.mark.parametrize("adapter", [None, "qv"])
def test_echo_logprobs_are_the_engines_prompt_logprobs(server, client, direct, adapter):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0. The text is the prompt,
    the first position has no logprob, every other is the engine's, in order."""
    model = adapter or server[1].model_name
    r = client.completions.create(model=model, prompt=PROMPT_IDS, echo=True, logprobs=1,
                                  max_tokens=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.text == server[1].tokenizer.decode(PROMPT_IDS)
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) and lp.token_logprobs[0] is None
    want = direct(PROMPT_IDS, adapter)
    np.testing.assert_allclose(lp.token_logprobs[1:], want[1:], rtol=0, atol=1e-5)
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_with_generated_tokens(server, client):
    """echo + max_tokens 2: the prompt's entries, then the two sampled ones; logprobs 0 puts
    the sampled token in top_logprobs (as vLLM does)."""
    r = client.completions.create(model="qv", prompt=PROMPT_IDS, echo=True, logprobs=0,
                                  max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 2
    prompt_text = server[1].tokenizer.decode(PROMPT_IDS)
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    for token, top in zip(lp.tokens[-2:], lp.top_logprobs[-2:]):
        assert list(top) == [token]
    plain = client.completions.create(model="qv", prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert choice.text == prompt_text + plain.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_ends_by_length_when_the_hidden_token_would_stop(client, stream):
    """The one token made for max_tokens 0 is never shown: every token id a stop token (so it
    surely stops) still gives finish_reason length and no stop_reason."""
    every = {"stop_token_ids": list(range(256))}  # the tiny vocabulary
    r = client.completions.create(model="qv", prompt=PROMPT_IDS, echo=True, max_tokens=0,
                                  stream=stream, extra_body=every)  # fmt: skip
    choices = [c for chunk in r for c in chunk.choices] if stream else r.choices
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    assert all(getattr(c, "stop_reason", None) is None for c in choices)


def test_max_tokens_zero_without_echo_returns_nothing(client):
    r = client.completions.create(model="qv", prompt=PROMPT_IDS, max_tokens=0)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == len(PROMPT_IDS)


def test_prompt_logprobs_field(server, direct):
    """vLLM's extension: completions put prompt_logprobs on the choice, chat on the response,
    as a list with None first and {token id: {logprob, rank, decoded_token}} after."""
    body = {"model": "qv", "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    want = direct(PROMPT_IDS, "qv")
    for pos, entry in enumerate(entries[1:], start=1):
        actual = entry[str(PROMPT_IDS[pos])]
        assert actual["logprob"] == pytest.approx(want[pos], abs=1e-5)
        assert {"logprob", "rank", "decoded_token"} <= set(actual)
        assert len(entry) >= 2
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", {"model": "qv", "messages": messages,
                                              "max_tokens": 1, "prompt_logprobs": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    chat_entries = r.json()["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])


@pytest.mark.parametrize("model", [None, "qv"])
def test_response_format_json_schema(server, client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}  # fmt: skip
    for seed in range(4):
        r = chat(client, model=model or server[1].model_name, response_format=fmt,
                 temperature=1.0, seed=seed, max_tokens=120)  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_response_format_json_object(server, client):
    r = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=200,
             logit_bias=favour(server, '"}'))  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("guided_choice", ["red", "green"], lambda t: t in ("red", "green")),
        ("guided_regex", r"[a-c]{2}[0-9]", lambda t: re.fullmatch(r"[a-c]{2}[0-9]", t)),
        ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
        ("guided_grammar", 'start: "x" "y"+', lambda t: re.fullmatch("xy+", t)),
        ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ("structured_outputs", {"regex": "[0-9]+!"}, lambda t: re.fullmatch("[0-9]+!", t)),
    ],
)
def test_vllm_guided_fields_on_both_endpoints(client, field, value, check):
    extra = {field: value}
    r = client.completions.create(model="qv", prompt=PROMPT_IDS, max_tokens=60, temperature=1,
                                  seed=3, extra_body=extra)  # fmt: skip
    assert check(r.choices[0].text), r.choices[0].text
    r = chat(client, max_tokens=60, temperature=1, seed=4, extra_body=extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_streamed_constrained_output_equals_the_whole(client):
    kw = dict(max_tokens=60, temperature=1, seed=9, extra_body={"guided_json": PERSON})
    whole = chat(client, **kw).choices[0].message.content
    chunks = chat(client, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_calls_a_tool(server, client, parallel):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(6):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1,
                 seed=seed, max_tokens=200, parallel_tool_calls=parallel,
                 logit_bias=favour(server, "]"))  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_streams_its_call(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(tools=[WEATHER, TIME], tool_choice=named, temperature=1, seed=5, max_tokens=80)
    whole = chat(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    chunks = [c for c in chat(client, stream=True, **kw) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].function.name == "get_time"
    assert deltas[0].id.startswith("call_") and all(d.id is None for d in deltas[1:])
    assert len(deltas) > 2  # the arguments stream as they are generated
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_logit_bias_bans_and_forces(server, client):
    free = client.completions.create(model="qv", prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    first = server[1].tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0]
    biased = client.completions.create(model="qv", prompt=PROMPT_IDS, max_tokens=3,
                                       temperature=0, logit_bias={str(first): -100, "66": 100},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert biased.choices[0].text == server[1].tokenizer.decode([66] * 3)


def test_tokenize_detokenize_version(server):
    r = post(server, "/tokenize", {"model": "qv", "prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    tok = server[1].tokenizer
    assert body["tokens"] == tok.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server[1].max_model_len
    messages = [{"role": "user", "content": "hi"}]
    r = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": True})
    rendered = tok.apply_chat_template(messages)
    assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    r = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    r = post(server, "/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.get(server[0] + "/version")
    assert r.status_code == 200 and re.fullmatch(r"\d+\.\d+.*", r.json()["version"])


def test_tools_reach_the_chat_template(server):
    """The model's template decides the format: a template that prints tools shows them."""
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    body = {"model": "qv", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "chat_template": template}  # fmt: skip
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert server[1].tokenizer.decode(r.json()["tokens"]) == "[get_weather]<user>hi"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, "response_format", "bogus"),
    ({"guided_regex": "(a"}, "guided_regex", "unclosed"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", "range"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "guided_json", "nowhere"),
    ({"logit_bias": {"300": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": -101}}, "logit_bias.5", "-100"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name",
     "name"),
    ({"tools": [dict(WEATHER, function=dict(WEATHER["function"], parameters={"type": 5}))],
      "tool_choice": "required"}, "tool_choice", "type"),
]  # fmt: skip


async def _bad_requests_beside_a_running_one(url: str) -> tuple[list, str, str]:
    messages = [{"role": "user", "content": "hi"}]
    running = {"model": "qv", "messages": messages, "max_tokens": 60, "temperature": 1,
               "seed": 11, "guided_json": PERSON}  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        first = asyncio.create_task(http.post("/v1/chat/completions", json=running))
        bad = [http.post("/v1/chat/completions", json={"model": "qv", "messages": messages,
                                                       "max_tokens": 5, **b})
               for b, _, _ in BAD]  # fmt: skip
        replies = await asyncio.gather(*bad)
        during = (await first).json()["choices"][0]["message"]["content"]
        alone = (await http.post("/v1/chat/completions", json=running)).json()
    return replies, during, alone["choices"][0]["message"]["content"]


def test_bad_constraints_fail_alone(server):
    """Each bad constraint is a 400 naming its field and the problem, while a constrained
    request runs beside them to the same output it has alone."""
    replies, during, alone = asyncio.run(_bad_requests_beside_a_running_one(server[0]))
    for r, (_, param, needle) in zip(replies, BAD):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and needle in error["message"], error
    assert during == alone
    jsonschema.validate(json.loads(during), PERSON)


def test_required_calls_cut_by_max_tokens_keep_the_complete_ones():
    from ort_lora.server.structured import OutputSpec, tool_calls

    spec = OutputSpec(tool_mode="required")
    whole = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]'
    cut = '[{"name":"f","parameters":{"a":1}},{"name":"g","param'
    for text, names in ((whole, ["f", "g"]), (cut, ["f"]), ('[{"name":"f","par', [])):
        content, calls = tool_calls(spec, text)
        assert [c["function"]["name"] for c in calls] == names
        assert content == (None if names else text)
    assert json.loads(tool_calls(spec, cut)[1][0]["function"]["arguments"]) == {"a": 1}


@pytest.mark.parametrize(
    "text", ["<tool_call>" + "[" * 100_000 + "</tool_call>",
             '<tool_call>{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000
             + "}</tool_call>"],
)  # fmt: skip
def test_hermes_parser_reads_deep_nesting_as_plain_text(text):
    """JSON nested deeper than the decoder can go is content, not a RecursionError (a 500)."""
    from ort_lora.server.structured import OutputSpec, tool_calls

    assert tool_calls(OutputSpec(tool_mode="auto"), text) == (text, [])
    required = OutputSpec(tool_mode="required")
    assert tool_calls(required, "[" + "[" * 100_000) == ("[" + "[" * 100_000, [])
