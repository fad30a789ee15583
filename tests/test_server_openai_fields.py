"""OpenAI compatibility against a fake engine (tests/test_server_fakes.py): every field of
OpenAI's chat-completions create parameters (the installed openai SDK's list) is honoured,
accepted without effect, or refused by name, as docs/API.md's table says; errors name the
field and never repeat the body; usage reports the prefix cache's tokens; chat logprobs list
the content's tokens; GET /tokenizer_info. The same on the live SmolLM2 server:
tests/test_server_openai_smollm2.py."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from test_server_fakes import FakeEngine, smollm2_tokenizer_dir  # noqa: F401

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app
from ort_lora.tokenizer import Tokenizer

API_MD = Path(__file__).resolve().parents[1] / "docs" / "API.md"
ROW = re.compile(r"^\| `([a-z_]+)` \| (honoured|no effect|refused)\b", re.MULTILINE)
MESSAGES = [{"role": "user", "content": "Say hello."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# A value for every chat field the SDK documents (not the default where one is refused)
EVERY_FIELD = {
    "messages": MESSAGES,
    "model": "fake-base",
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"300": 1},
    "logprobs": True,
    "max_completion_tokens": 5,
    "max_tokens": 6,
    "metadata": {"team": "eval", "run": "7"},
    "modalities": ["text"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Hello"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "greetings",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "none",
    "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    "safety_identifier": "user-8f3a",
    "seed": 7,
    "service_tier": "flex",
    "stop": ["\n\n"],
    "store": True,
    "stream": False,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.7,
    "tool_choice": "none",
    "tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u-1",
    "verbosity": "medium",
    "web_search_options": {"search_context_size": "low"},
}


class CachingEngine(FakeEngine):
    """The fake engine, its outputs saying the prefix cache held the prompt's first third."""

    async def generate(self, prompt, params, lora_request=None, request_id=None):
        async for out in super().generate(prompt, params, lora_request, request_id):
            yield replace(out, num_cached_tokens=len(out.prompt_token_ids) // 3)


@pytest.fixture(scope="module")
def server(smollm2_tokenizer_dir):  # noqa: F811
    engine = CachingEngine(Tokenizer.from_model_dir(smollm2_tokenizer_dir), max_model_len=128)
    with ServerThread(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def documented() -> dict[str, str]:
    """docs/API.md's table: field -> honoured / no effect / refused."""
    return dict(ROW.findall(API_MD.read_text()))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, timeout=30)


def check_400(r: httpx.Response, param: str, exact: bool = True) -> str:
    """The 400's message; its param is `param` (or, not `exact`, a field inside it)."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    named = error["param"] if exact else error["param"].split(".")[0]
    assert named == param, error
    return error["message"]


# -- the fields --------------------------------------------------------------------------------


def sdk_fields() -> set[str]:
    """The chat-completions create parameters of the installed openai SDK."""
    return set(CompletionCreateParamsBase.__annotations__) | {"stream"}


def every_field() -> dict:
    """EVERY_FIELD, as far as the installed SDK knows them."""
    return {k: v for k, v in EVERY_FIELD.items() if k in sdk_fields()}


def test_docs_table_covers_every_sdk_field():
    """A field a newer SDK adds fails here until docs/API.md says what it does."""
    assert sdk_fields() <= set(documented())
    assert sdk_fields() <= set(EVERY_FIELD)
    assert set(documented()) == set(EVERY_FIELD)


def create_dropping_refused(client, fields: dict, table: dict):
    """(the reply, the fields dropped): `fields` sent again without each field a 400 names,
    every such field one docs/API.md's table lists as refused, named in the message too."""
    refused = []
    while True:
        try:
            return client.chat.completions.create(**fields), refused
        except openai.BadRequestError as exc:
            assert table.get(exc.param) == "refused", exc.message
            assert exc.param in exc.message
            refused.append(exc.param)
            del fields[exc.param]


@pytest.mark.parametrize("stream", [False, True])
def test_every_documented_field_at_once(client, stream):
    """All fields in one request: each 400 names a field docs/API.md lists as refused; without
    those, a 200."""
    table = documented()
    fields = {**every_field(), "stream": stream}
    if not stream:
        del fields["stream_options"]  # a 400 of its own without stream (below)
    res, refused = create_dropping_refused(client, fields, table)
    sent_refused = {k for k in fields.keys() | set(refused) if table[k] == "refused"}
    neutral = {"modalities", "reasoning_effort", "verbosity"}  # sent with an accepted value
    assert set(refused) == sent_refused - neutral and refused
    if stream:
        chunks = list(res)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
        assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    else:
        assert len(res.choices) == 2 and res.choices[0].logprobs.content


@pytest.mark.parametrize(
    "field,value",
    [
        ("metadata", {f"k{i}": "v" for i in range(17)}),
        ("metadata", {"k" * 65: "v"}),
        ("metadata", {"k": "v" * 513}),
        ("metadata", {"k": 1}),
        ("safety_identifier", "x" * 129),
        ("service_tier", "turbo"),
        ("store", "yes"),
        ("prompt_cache_retention", "forever"),
        ("prompt_cache_options", {"mode": "sometimes"}),
        ("modalities", ["text", "audio"]),
        ("verbosity", "low"),
        ("reasoning_effort", "high"),
    ],
)
def test_checked_no_effect_and_refused_values_name_the_field(server, field, value):
    body = {"model": "fake-base", "messages": MESSAGES, "max_tokens": 2, field: value}
    message = check_400(post(server, "/v1/chat/completions", body), field, exact=False)
    assert message.startswith(field) or f"{field} is not supported" in message


def test_no_effect_fields_leave_the_output_alone(server):
    body = {"model": "fake-base", "messages": MESSAGES, "max_tokens": 6, "seed": 1}
    plain = post(server, "/v1/chat/completions", body).json()
    extra = {"store": True, "metadata": {"a": "b"}, "service_tier": "priority", "user": "u",
             "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "medium",
             "prompt_cache_retention": "in_memory", "reasoning_effort": "none"}  # fmt: skip
    both = post(server, "/v1/chat/completions", {**body, **extra}).json()
    assert both["choices"] == plain["choices"]


def test_null_means_the_default(server):
    """OpenAI's nullable n, stream and logprobs: null is their default."""
    body = {"model": "fake-base", "messages": MESSAGES, "max_tokens": 2}
    r = post(server, "/v1/chat/completions", {**body, "n": None, "stream": None, "logprobs": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    assert r.json()["choices"][0]["logprobs"] is None
    r = post(server, "/v1/completions", {"model": "fake-base", "prompt": "x", "echo": None})
    assert r.status_code == 200, r.text


def test_json_object_with_schema_is_that_schema(server, client):
    """instructor's JSON_SCHEMA mode: response_format {"type": "json_object", "schema"}."""
    engine = server[1]
    client.chat.completions.create(
        model="fake-base", messages=MESSAGES, max_tokens=2,
        response_format={"type": "json_object", "schema": SCHEMA},  # type: ignore[typeddict-item]
    )  # fmt: skip
    constraint = engine.params[-1].structured_outputs
    assert constraint.json == SCHEMA and not constraint.json_object
    client.chat.completions.create(
        model="fake-base", messages=MESSAGES, max_tokens=2,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert engine.params[-1].structured_outputs.json_object


# -- errors ----------------------------------------------------------------------------------


def test_errors_name_the_field_and_never_repeat_the_body(server):
    marker = "do-not-echo-4711"
    body = {"model": "fake-base", "messages": [{"role": "user", "content": marker}]}
    cases = [
        ({**body, "top_logprobs": 2}, "top_logprobs"),
        ({**body, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**body, "response_format": {"type": "json_schema"}}, "response_format"),
        ({**body, "response_format": {"type": "text", "schema": SCHEMA}}, "response_format.schema"),
    ]
    for payload, param in cases:
        r = post(server, "/v1/chat/completions", payload)
        assert param in check_400(r, param) and marker not in r.text
    r = post(server, "/v1/completions", {"model": "fake-base", "prompt": marker,
                                         "stream_options": {"include_usage": True}})  # fmt: skip
    assert "stream: true" in check_400(r, "stream_options") and marker not in r.text


def test_lone_surrogate_names_its_field(server):
    raw = b'{"model": "fake-base", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = httpx.post(server[0] + "/v1/chat/completions", content=raw,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert "messages[0].content" in check_400(r, "messages")


def test_too_long_prompt_names_the_prompt(server):
    """The prompt alone over the context: `messages` (chat) or `prompt` (completions);
    prompt + max_tokens over it: `max_tokens`."""
    long = "word " * 200  # about 200 tokens, more than the fake's 128
    chat = {"model": "fake-base", "messages": [{"role": "user", "content": long}]}
    assert "the prompt has" in check_400(post(server, "/v1/chat/completions", chat), "messages")
    cmpl = {"model": "fake-base", "prompt": long, "max_tokens": 1}
    assert "the prompt has" in check_400(post(server, "/v1/completions", cmpl), "prompt")
    ids = {"model": "fake-base", "prompt": [300] * 128, "max_tokens": 1}
    check_400(post(server, "/v1/completions", ids), "prompt")
    short = {"model": "fake-base", "prompt": "word " * 20, "max_tokens": 120}
    assert "in the completion" in check_400(post(server, "/v1/completions", short), "max_tokens")
    chat = {**chat, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 127}
    check_400(post(server, "/v1/chat/completions", chat), "max_tokens")


# -- usage -----------------------------------------------------------------------------------


def test_usage_reports_cached_tokens(server, client):
    """cached_tokens is the sum of RequestOutput.num_cached_tokens over the prompts:
    non-streaming, in the final usage chunk and in every continuous-usage chunk."""
    prompts = ["one two three four five six", "seven eight nine"]
    tok = server[1].tokenizer
    want = sum(len(tok.encode(p)) // 3 for p in prompts)
    assert want > 0
    res = client.completions.create(model="fake-base", prompt=prompts, max_tokens=3)
    assert res.usage.prompt_tokens_details.cached_tokens == want
    stream = client.completions.create(
        model="fake-base", prompt=prompts, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want
    for c in chunks[:-1]:
        assert 0 < c.usage.prompt_tokens_details.cached_tokens <= want  # the outputs so far
    res = client.chat.completions.create(model="fake-base", messages=MESSAGES, max_tokens=2)
    assert res.usage.prompt_tokens_details.cached_tokens == res.usage.prompt_tokens // 3


# -- logprobs --------------------------------------------------------------------------------


@pytest.fixture()
def scripted(server):
    """The fake says "Hello there." then <|im_end|> (its EOS), finish_reason "stop"."""
    engine = server[1]
    tok = engine.tokenizer
    engine.script = tok.encode("Hello there.", add_special_tokens=False) + [tok.eos_token_id]
    yield engine
    engine.script = None


def test_chat_logprobs_are_the_contents_tokens(client, scripted):
    """One entry per token of the content, none for <|im_end|>: joined, they are the
    content; the stream's entries are the same."""
    kw = {"model": "fake-base", "messages": MESSAGES, "max_tokens": 10, "logprobs": True}
    res = client.chat.completions.create(**kw, top_logprobs=1)
    choice = res.choices[0]
    tokens = [e.token for e in choice.logprobs.content]
    assert choice.finish_reason == "stop" and choice.message.content == "Hello there."
    assert "".join(tokens) == choice.message.content and "<|im_end|>" not in tokens
    assert res.usage.completion_tokens == len(tokens) + 1  # the EOS is generated all the same
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed == tokens


def test_completion_logprobs_keep_the_stop_token(client, scripted):
    """Completions list every generated token, the EOS too (vLLM, OpenAI; lm-eval reads an
    echo's last entry as the generated token)."""
    res = client.completions.create(model="fake-base", prompt="hi", max_tokens=10, logprobs=0)
    lp = res.choices[0].logprobs
    assert res.choices[0].text == "Hello there." and res.choices[0].finish_reason == "stop"
    assert lp.tokens[-1] == "<|im_end|>" and "".join(lp.tokens[:-1]) == res.choices[0].text
    assert len(lp.tokens) == res.usage.completion_tokens == len(scripted.script)


# -- /tokenizer_info ---------------------------------------------------------------------------


def test_tokenizer_info_in_vllms_shape(server, smollm2_tokenizer_dir):  # noqa: F811
    info = httpx.get(server[0] + "/tokenizer_info").json()
    tok = server[1].tokenizer
    config = json.loads((Path(smollm2_tokenizer_dir) / "tokenizer_config.json").read_text())
    assert info["eos_token"] == tok.special_tokens["eos_token"] == "<|im_end|>"
    assert info["bos_token"] == tok.special_tokens["bos_token"]
    assert info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(info)
    r = httpx.post(server[0] + "/tokenize", json={"prompt": info["eos_token"],
                                                  "add_special_tokens": False})  # fmt: skip
    assert r.json()["tokens"] == [tok.eos_token_id]  # how lm-eval finds the EOS id
