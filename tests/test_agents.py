"""Agent frameworks, with what they send by default, against a live server on the default
model (conftest's `smollm2_server`: SmolLM2-135M-Instruct, whose chat template ignores
tools, no --tool-call-parser): the openai-agents SDK's Responses model (its default) and its
chat completions model, LangChain's bind_tools in an agent loop, instructor's TOOLS and
JSON_SCHEMA modes.

A 135M model does not call tools by judgement reliably, so each agent's first turn forces a
call (tool_choice "required": the grammar makes it valid) and later turns run on "auto",
where the model may answer or call again. The oracles are the plumbing, never the model's
choice: the tool ran with arguments valid for its schema, its result went back in the next
request under the call's id, every "auto" reply is text or a well-formed call, and the
tools reached the prompt of an "auto" request.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # nothing goes to the network

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
MAX_TOKENS = 48


def weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


class Recorder:
    """The JSON bodies an httpx client sent, in order (an event hook)."""

    def __init__(self):
        self.bodies: list[dict] = []

    def sync(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))

    async def hook(self, request: httpx.Request) -> None:
        self.sync(request)


def base_model(server) -> str:
    return server[1].model_name


# -- openai-agents ----------------------------------------------------------------------------


def run_agent(url: str, model_class: str, model: str, stream: bool):
    """A weather agent: required on the first turn, then auto (the SDK resets tool_choice
    after a call). (calls the tool got, the run's final output or None, request bodies)."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    recorder, calls = Recorder(), []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return weather(city)

    async def main():
        http = httpx.AsyncClient(event_hooks={"request": [recorder.hook]})
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http,
                                    max_retries=0)  # fmt: skip
        cls = {"responses": OpenAIResponsesModel, "chat": OpenAIChatCompletionsModel}[model_class]
        # a response cut short by max_tokens is "incomplete", which fails the run (as on
        # OpenAI's API): room for the answer
        settings = ModelSettings(tool_choice="required", max_tokens=4 * MAX_TOKENS, temperature=0)
        agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                      tools=[get_weather], model=cls(model=model, openai_client=client),
                      model_settings=settings)  # fmt: skip
        question = "What is the weather in Oslo?"
        try:
            if not stream:
                return (await Runner.run(agent, question, max_turns=3)).final_output
            result = Runner.run_streamed(agent, question, max_turns=3)
            async for _ in result.stream_events():
                pass
            return result.final_output
        except MaxTurnsExceeded:  # "auto" called the tool on every turn: the model's choice
            return None

    return calls, asyncio.run(main()), recorder.bodies


@pytest.mark.parametrize(
    "model_class,stream",
    [("responses", False), ("responses", True), ("chat", False)],
    ids=["responses", "responses-stream", "chat-completions"],
)
def test_openai_agents_tool_round_trip(smollm2_server, model_class, stream):
    model = base_model(smollm2_server)
    calls, final, bodies = run_agent(smollm2_server[0], model_class, model, stream)
    assert calls and all(isinstance(c, str) and c for c in calls), calls
    assert final is None or isinstance(final, str)
    assert len(bodies) >= 2 and all(b["model"] == model for b in bodies)
    first, second = bodies[0], bodies[1]
    assert first["tool_choice"] == "required" and "tool_choice" not in second  # then auto
    if model_class == "responses":
        assert not first.get("store") and "previous_response_id" not in second
        (call,) = [i for i in second["input"] if i.get("type") == "function_call"]
        (result,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
    else:
        call = second["messages"][-2]["tool_calls"][0]
        result = second["messages"][-1]
        call = {"call_id": call["id"], "arguments": call["function"]["arguments"]}
        result = {"call_id": result["tool_call_id"], "output": result["content"]}
    assert result["call_id"] == call["call_id"]
    city = json.loads(call["arguments"])["city"]
    assert result["output"] == weather(city) and city == calls[0]


# -- LangChain --------------------------------------------------------------------------------


def test_langchain_bind_tools_agent_loop(smollm2_server):
    """bind_tools with a forced first call, then an agent loop on "auto" (at most three
    turns): every reply is text or calls LangChain parsed (none it could not), and each
    result goes back as a ToolMessage under its call's id."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather(city)

    recorder = Recorder()
    http = httpx.Client(event_hooks={"request": [recorder.sync]})
    llm = ChatOpenAI(base_url=smollm2_server[0] + "/v1", api_key="unused", temperature=0,
                     model=base_model(smollm2_server), max_tokens=MAX_TOKENS, max_retries=0,
                     http_client=http)  # fmt: skip
    messages = [HumanMessage("What is the weather in Oslo?")]
    reply = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    assert reply.tool_calls and not reply.invalid_tool_calls
    auto = llm.bind_tools([get_weather])
    for _ in range(3):
        messages.append(reply)
        for call in reply.tool_calls:
            assert call["name"] == "get_weather"
            jsonschema.validate(call["args"], CITY)
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
        reply = auto.invoke(messages)
        assert not reply.invalid_tool_calls and isinstance(reply.content, str)
        if not reply.tool_calls:
            break
    sent = recorder.bodies[1]["messages"]
    assert sent[-1]["tool_call_id"] == sent[-2]["tool_calls"][0]["id"]
    assert "tool_choice" not in recorder.bodies[1]  # "auto" by default
    chunks = list(auto.stream([HumanMessage("What is the weather in Paris?")]))
    whole = sum(chunks[1:], chunks[0])
    assert not whole.invalid_tool_calls and (whole.content or whole.tool_calls)


# -- instructor -------------------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(smollm2_server, mode):
    """TOOLS sends a named tool_choice, JSON_SCHEMA a json_schema response_format: both
    enforced by the grammar, both parse into the model."""
    import instructor

    recorder = Recorder()
    http = httpx.Client(event_hooks={"request": [recorder.sync]})
    client = openai.OpenAI(base_url=smollm2_server[0] + "/v1", api_key="unused",
                           http_client=http, max_retries=0)  # fmt: skip
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person = patched.chat.completions.create(
        model=base_model(smollm2_server), response_model=Person, max_retries=0,
        max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Alice is 31 years old. Extract the person."}],
    )  # fmt: skip
    assert isinstance(person, Person)
    sent = recorder.bodies[-1]
    if mode == "TOOLS":
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
    else:
        assert sent["response_format"]["json_schema"]["schema"]["title"] == "Person"


# -- "auto" and usage through the plain client ------------------------------------------------


def test_auto_is_text_or_a_well_formed_call(smollm2_server):
    """With no parser flag "auto" is served on both APIs; the tools are in its prompt."""
    url, model = smollm2_server[0], base_model(smollm2_server)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    function = {"name": "get_weather", "description": "Get the weather in a city.",
                "parameters": CITY}  # fmt: skip
    tool = {"type": "function", "function": function}
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    chat = client.chat.completions.create(model=model, messages=messages, tools=[tool],
                                          max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    message = chat.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)
    assert message.tool_calls or isinstance(message.content, str)
    r = client.responses.create(model=model, input=messages, max_output_tokens=MAX_TOKENS,
                                tools=[{"type": "function", **function}])  # fmt: skip
    assert all(o.type in ("message", "function_call") for o in r.output) and r.output
    for item in r.output:
        assert item.type == "message" or json.loads(item.arguments) is not None
    body = {"model": model, "messages": messages, "tools": [tool]}
    prompt = httpx.post(url + "/tokenize", json=body).json()["tokens"]
    text = smollm2_server[1].tokenizer.decode(prompt)
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text


def test_responses_usage_counts_cached_input(smollm2_server):
    """The same input twice: the second run's prompt comes from the prefix cache."""
    client = openai.OpenAI(base_url=smollm2_server[0] + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="json", input="Describe a cat called Tom who lives in Paris, as JSON.",
              instructions="Answer in JSON.", max_output_tokens=4)  # fmt: skip
    client.responses.create(**kw)
    usage = client.responses.create(**kw).usage
    cached = usage.input_tokens_details.cached_tokens
    assert 0 < cached <= usage.input_tokens and 0 < usage.output_tokens <= 4
