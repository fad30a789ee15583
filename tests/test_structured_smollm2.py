"""Structured outputs and tools with a real model: SmolLM2-135M-Instruct and the demo adapters
behind a live server (conftest's `smollm2_server`), through LangChain's
`with_structured_output` and the openai client. Oracles: pydantic (LangChain's parse) and
jsonschema."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

PROMPT = "Alice is 31 years old and lives in Paris. Extract the person."


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's first name", max_length=20)
    age: int = Field(description="age in years", ge=0, le=150)


def models(server, adapters) -> list[str]:
    return [server[1].model_name, *sorted(adapters)]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(smollm2_server, demo_adapters, method):
    """json_schema sends response_format (strict), function_calling a named tool_choice:
    both return a Person, for the base model and every adapter."""
    from langchain_openai import ChatOpenAI

    for model in models(smollm2_server, demo_adapters):
        llm = ChatOpenAI(base_url=smollm2_server[0] + "/v1", api_key="unused", model=model,
                         temperature=0, max_tokens=60, max_retries=0)  # fmt: skip
        result = llm.with_structured_output(Person, method=method).invoke(PROMPT)
        assert isinstance(result, Person), (model, result)
    base = ChatOpenAI(base_url=smollm2_server[0] + "/v1", api_key="unused",
                      model=smollm2_server[1].model_name, temperature=0, max_tokens=60)  # fmt: skip
    assert base.with_structured_output(Person, method=method).invoke(PROMPT).name == "Alice"


SCHEMAS = [
    Person.model_json_schema() | {"additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "sunny": {"type": "boolean"}},
     "required": ["city", "sunny"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["colour", "count"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "string", "maxLength": 12},
                                                            {"type": "null"}]}},
     "required": ["answer"], "additionalProperties": False},
]  # fmt: skip
QUESTIONS = [
    "Describe a person as JSON.",
    "What is the weather in Rome? Answer as JSON.",
    "Pick a colour and a count.",
    "List up to three small numbers.",
    "What is the capital of France?",
]


async def _schema_requests(url: str, names: list[str], n: int) -> list[tuple[int, str]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[int, str]:
        k = i % len(SCHEMAS)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k]}}
        r = await client.chat.completions.create(
            model=names[i % len(names)], messages=[{"role": "user", "content": QUESTIONS[k]}],
            response_format=fmt, max_tokens=120, temperature=0.7, seed=i,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return k, r.choices[0].message.content

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_100_json_schema_requests_in_mixed_batches(smollm2_server, demo_adapters):
    """100 concurrent requests, five schemas over the base model and every adapter (32 rows a
    step, each with its own grammar state and adapter): every output parses and validates."""
    names = models(smollm2_server, demo_adapters)
    results = asyncio.run(_schema_requests(smollm2_server[0], names, 100))
    for k, text in results:
        jsonschema.validate(json.loads(text), SCHEMAS[k])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}  # fmt: skip
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string",
                                                                  "maxLength": 40}},
                       "required": ["query"]},
    },
}  # fmt: skip


async def _required_calls(url: str, names: list[str]) -> list:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    return await asyncio.gather(*(
        client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, SEARCH],
                                       tool_choice="required", max_tokens=150, temperature=0.8,
                                       seed=i)
        for i, model in enumerate(names * 3)
    ))  # fmt: skip


def test_tool_choice_required_always_returns_valid_calls(smollm2_server, demo_adapters):
    """Three sampled requests per model, concurrent: every reply calls a tool with valid
    arguments."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    replies = asyncio.run(_required_calls(smollm2_server[0], models(smollm2_server, demo_adapters)))
    for r in replies:
        choice = r.choices[0]
        # "length": the model went on calling past max_tokens; the complete calls are kept
        assert choice.finish_reason in ("tool_calls", "length"), choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
