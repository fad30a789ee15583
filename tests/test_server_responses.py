"""POST /v1/responses against the fake engine (tests/test_server_fakes.py), through the
openai client: the request runs as the chat request it translates to (oracle: the prompt
ids and output of that chat request), output items and their event stream, tool calls,
text.format, usage and status, and the 4xx answers."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server_fakes import FakeEngine, smollm2_tokenizer_dir  # noqa: F401

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app
from ort_lora.tokenizer import Tokenizer

TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
)


@pytest.fixture(scope="module")
def server(smollm2_tokenizer_dir, tmp_path_factory):  # noqa: F811
    """(url, engine, tokenizer): the base model and adapter "alpha"."""
    tok = Tokenizer.from_model_dir(smollm2_tokenizer_dir)
    engine = FakeEngine(tok)
    adapter = tmp_path_factory.mktemp("adapters") / "alpha"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    engine.add_lora(LoRARequest("alpha", 1, str(adapter)))
    with ServerThread(create_app(engine)) as url:
        yield url, engine, tok


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def script(server):
    """script(text): the fake model says `text`, then stops (until the test ends)."""
    engine, tok = server[1], server[2]

    def say(text: str) -> None:
        engine.script = tok.encode(text, add_special_tokens=False)

    yield say
    engine.script = None


def last_prompt(server) -> list[int]:
    return server[1].prompts[-1]


@pytest.mark.parametrize("model", ["fake-base", "alpha"])
def test_text_input_runs_as_its_chat_request(server, client, model):
    """instructions + input text: the prompt and output of the chat request with a system
    and a user message; max_output_tokens cuts it short: status incomplete."""
    r = client.responses.create(model=model, instructions="Be brief.", input="Hello there",
                                max_output_tokens=7)  # fmt: skip
    prompt = last_prompt(server)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=7)
    assert last_prompt(server) == prompt
    assert r.output_text == chat.choices[0].message.content and r.model == model
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert r.id.startswith("resp_") and r.object == "response" and r.store is False
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, 7)
    assert u.total_tokens == u.input_tokens + 7 and u.input_tokens_details.cached_tokens == 0


def test_items_become_the_chat_conversation(server, client):
    """Message items (parts joined), a replayed output message, function calls merged into
    the assistant turn before them, their outputs as tool messages: the prompt of the same
    conversation sent to chat completions."""
    parts = [
        {"type": "input_text", "text": "Weather in "},
        {"type": "input_text", "text": "Paris?"},
    ]
    replayed = [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": parts},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": replayed},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]  # fmt: skip
    client.responses.create(model="fake-base", input=items, tools=[TOOL], max_output_tokens=2)
    prompt = last_prompt(server)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    ]
    client.chat.completions.create(model="fake-base", messages=messages, tools=[CHAT_TOOL],
                                   max_tokens=2)  # fmt: skip
    assert last_prompt(server) == prompt
    text = server[2].decode(prompt)
    assert "<tool_call>" in text and "<tool_response>\nsunny" in text  # SmolLM2's: as text


def test_auto_tool_calls_are_function_call_items(client, script):
    script(HERMES)
    r = client.responses.create(model="fake-base", input="Weather?", tools=[TOOL])
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text.strip() == "Let me check." and r.status == "completed"
    calls = [(o.name, json.loads(o.arguments), o.status) for o in r.output[1:]]
    assert calls == [("get_weather", {"city": "Paris"}, "completed"),
                     ("get_weather", {"city": "Rome"}, "completed")]  # fmt: skip
    assert len({o.call_id for o in r.output[1:]}) == 2
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") for o in r.output[1:])


def events_of(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def check_stream(events, whole) -> None:
    """Numbered events in OpenAI's order; what the deltas add up to is what the final
    response holds, and that is the non-streamed response (but for its ids)."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}" and final.id == events[0].response.id
    strip = {"id", "call_id"}
    assert [o.model_dump(exclude=strip) for o in final.output] == [
        o.model_dump(exclude=strip) for o in whole.output
    ]
    for index, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[0].item.id == item.id
        assert mine[-1].type == "response.output_item.done" and mine[-1].item == item
        if item.type == "message":
            deltas = "".join(e.delta for e in mine if e.type == "response.output_text.delta")
            assert deltas == item.content[0].text
            kinds = [e.type for e in mine]
            assert kinds[1] == "response.content_part.added"
            assert kinds[-3:-1] == ["response.output_text.done", "response.content_part.done"]
        else:
            args = [e for e in mine if e.type.startswith("response.function_call_arguments")]
            assert "".join(e.delta for e in args[:-1]) == item.arguments
            assert args[-1].type.endswith(".done") and args[-1].arguments == item.arguments


def test_stream_of_text_and_calls(client, script):
    script(HERMES)
    kw = dict(model="fake-base", input="Weather?", tools=[TOOL])
    events = events_of(client, **kw)
    check_stream(events, client.responses.create(**kw))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "<" not in text  # never a piece of a call's tag


def test_stream_of_plain_text_cut_short(client):
    kw = dict(model="alpha", input="Tell me more", max_output_tokens=9)
    events = events_of(client, **kw)
    check_stream(events, client.responses.create(**kw))
    assert events[-1].type == "response.incomplete"
    assert sum(e.type == "response.output_text.delta" for e in events) > 2


def test_named_tool_choice_streams_its_arguments(server, client, script):
    script('{"city": "Paris"}')
    kw = dict(model="fake-base", input="Weather?", tools=[TOOL],
              tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    whole = client.responses.create(**kw)
    (call,) = whole.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    params = server[1].params[-1].structured_outputs
    assert params.json == TOOL["parameters"]  # the grammar of the named function's arguments
    events = events_of(client, **kw)
    check_stream(events, whole)
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 2


def test_required_tool_choice_is_the_chat_grammar(server, client, script):
    script('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    r = client.responses.create(model="fake-base", input="Weather?", tools=[TOOL],
                                tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    (call,) = r.output
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    schema = server[1].params[-1].structured_outputs.json
    assert schema["type"] == "array" and schema["maxItems"] == 1


def test_text_format_is_the_structured_output(server, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    r = client.responses.create(model="fake-base", input="x", text={"format": fmt},
                                max_output_tokens=3)  # fmt: skip
    so = server[1].params[-1].structured_outputs
    assert so.json == schema and so.strict and r.text.format.name == "thing"
    client.responses.create(model="fake-base", input="x", max_output_tokens=3,
                            text={"format": {"type": "json_object"}})  # fmt: skip
    assert server[1].params[-1].structured_outputs.json_object


def test_sampling_fields_reach_the_engine(server, client):
    r = client.responses.create(model="fake-base", input="x", max_output_tokens=3,
                                temperature=0.5, top_p=0.75)  # fmt: skip
    params = server[1].params[-1]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.75, 3)
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.5, 0.75, 3)


def test_agents_sdk_defaults_are_accepted(server, client):
    """What openai-agents sends by default: include [], no store, strict tools."""
    body = {"model": "fake-base", "input": [{"role": "user", "content": "hi"}], "include": [],
            "tools": [TOOL | {"strict": True}], "max_output_tokens": 2,
            "stream_options": {"include_obfuscation": False}, "metadata": {"k": "v"},
            "reasoning": {"effort": None}, "truncation": "disabled", "store": False}  # fmt: skip
    r = httpx.post(server[0] + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server[0] + "/v1/responses", json={"model": "fake-base"} | body)


ERRORS = [
    ({"input": "x", "store": True}, "store", "send the whole conversation"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "cannot be included"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input", "web_search_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.items.0.message.content", "text only"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[0].call_id", "c9"),
    ({"input": []}, "input", "empty"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "nope"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format",
     "schema"),
    ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x" * 1_000_000}, "input", "characters"),
    ({"input": "x", "frobnicate": 1}, "frobnicate", "unknown"),
    ({"input": "x", "temperature": 3}, "temperature", "less than or equal"),
]  # fmt: skip


@pytest.mark.parametrize("body,param,words", ERRORS, ids=[e[1] for e in ERRORS])
def test_bad_requests_are_400s_naming_the_field(server, body, param, words):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_unknown_model_and_stored_responses_are_404s(server):
    r = post(server, {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server[0] + "/v1/responses/resp_123")
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "response_not_found"


def test_openapi_documents_the_route(server):
    schema = httpx.get(server[0] + "/openapi.json").json()
    body = schema["paths"]["/v1/responses"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequest")


def test_a_failure_mid_stream_is_a_response_failed_event():
    """After the headers a failure goes in-band: the text so far, then response.failed with
    the error's code and message (the fake serving fails after one output)."""
    import asyncio
    from types import SimpleNamespace

    from ort_lora.outputs import CompletionOutput, RequestOutput
    from ort_lora.server.errors import APIError
    from ort_lora.server.openai_responses_format import ResponseFormat
    from ort_lora.server.openai_responses_protocol import ResponsesRequest
    from ort_lora.server.serving import ChatRun
    from ort_lora.server.structured import OutputSpec

    class Failing:
        async def iterate(self, job):
            yield (
                job,
                RequestOutput(
                    "r", None, [1, 2], None, [CompletionOutput(0, "Hi", [5], None, None)]
                ),
            )
            raise APIError(400, "adapter 'x' failed to load", code="adapter_load_failed")

    run = ChatRun(SimpleNamespace(prompt_ids=[1, 2]), OutputSpec(), "x", "resp_1")
    fmt = ResponseFormat(Failing(), ResponsesRequest(input="hi"), run, "resp_1")

    async def collect():
        return [chunk async for chunk in fmt.stream()]

    events = [json.loads(c.split("data: ", 1)[1]) for c in asyncio.run(collect())]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.failed",
    ]  # fmt: skip
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["id"] == "resp_1"
    assert response["error"] == {"code": "adapter_load_failed",
                                 "message": "adapter 'x' failed to load"}  # fmt: skip
