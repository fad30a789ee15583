"""Tools for chat templates that ignore them (server/tool_prompt.py): which templates do, the
parser each implies, the prompt the server renders (through the FakeEngine server: the
prompt ids the engine got), and that tool_choice "auto" works without --tool-call-parser.
Oracle for prompts: the SmolLM2 tokenizer's own rendering of the expected messages."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server_fakes import FakeEngine, smollm2_tokenizer_dir  # noqa: F401

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app
from ort_lora.server.tool_prompt import HERMES_TOOLS_INTRO, TemplateTools, ToolPrompting
from ort_lora.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# Qwen2.5's way, shortened: tools in <tools>, calls as <tool_call>
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call as <tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
)
FOREIGN_TEMPLATE = (
    "{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_dir):  # noqa: F811
    return Tokenizer.from_model_dir(smollm2_tokenizer_dir)


@pytest.mark.parametrize(
    "template,expected",
    [
        (None, TemplateTools(False, "hermes")),  # SmolLM2's: ignores tools
        (HERMES_TEMPLATE, TemplateTools(True, "hermes")),
        (FOREIGN_TEMPLATE, TemplateTools(True, None)),
        ("{{ raise_exception('no') }}", TemplateTools(True, None)),  # fails on the probe
    ],
    ids=["smollm2", "hermes", "foreign", "failing"],
)
def test_probe_tells_what_a_template_does_with_tools(tok, template, expected):
    assert ToolPrompting(tok).for_template(template) == expected


def test_probe_runs_once_per_template(tok, monkeypatch):
    prompting = ToolPrompting(tok)
    renders = []
    real = tok.apply_chat_template
    monkeypatch.setattr(
        tok, "apply_chat_template", lambda *a, **k: renders.append(1) or real(*a, **k)
    )
    first = prompting.for_template(None)
    assert prompting.for_template(tok.chat_template) is first and len(renders) == 2


def expected_history() -> list[dict]:
    """HISTORY as a Hermes template has it (Qwen2.5's layout)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": call},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                    "<tool_response>\n21 C\n</tool_response>"},
    ]  # fmt: skip


def test_calls_and_results_become_hermes_text(tok):
    folded = TemplateTools(False, "hermes").messages(HISTORY, [WEATHER], show=False)
    assert folded == expected_history()
    shown = TemplateTools(False, "hermes").messages(HISTORY, [WEATHER], show=True)
    system = shown[0]["content"]
    assert shown[1:] == expected_history()
    assert system.startswith(HERMES_TOOLS_INTRO) and json.dumps(WEATHER) in system
    assert system.rstrip().endswith("</tool_call>")  # how to call: the parser's format
    assert TemplateTools(True, None).messages(HISTORY, [WEATHER], show=True) == HISTORY


def test_tools_join_an_existing_system_prompt():
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    shown = TemplateTools(False, "hermes").messages(messages, [WEATHER], show=True)
    assert shown[0]["content"].startswith("Be brief.\n\n" + HERMES_TOOLS_INTRO)
    assert shown[1:] == HISTORY[:1] and messages[0]["content"] == "Be brief."  # not mutated


@pytest.fixture(scope="module")
def served(tok):
    """(client, engine, url): the FakeEngine over SmolLM2's tokenizer, no --tool-call-parser."""
    engine = FakeEngine(tok, max_model_len=2048)
    with ServerThread(create_app(engine)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine, url


def rendered(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_the_prompt_shows_tools_for_auto_only(served, tok, choice):
    """ "auto" (the default, with no parser flag): the tools and how to call them are in the
    prompt; "required" and "none" leave them out (the grammar decides the call, or none is
    wanted). Earlier calls and results are Hermes text in every mode."""
    client, engine, _ = served
    client.chat.completions.create(model="fake-base", messages=HISTORY, tools=[WEATHER],
                                   tool_choice=choice, max_tokens=2)  # fmt: skip
    shown = TemplateTools(False, "hermes").messages(HISTORY, [WEATHER], show=choice == "auto")
    assert engine.prompts[-1] == rendered(tok, shown)
    assert ("<tools>" in tok.decode(engine.prompts[-1])) == (choice == "auto")


def test_auto_without_the_flag_reads_calls(served, tok):
    """The model's template implies the Hermes parser: a call it writes is a tool call."""
    client, engine, _ = served
    engine.script = tok.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
                               "</tool_call>", add_special_tokens=False)  # fmt: skip
    try:
        r = client.chat.completions.create(model="fake-base", messages=HISTORY[:1],
                                           tools=[WEATHER], max_tokens=60)  # fmt: skip
    finally:
        engine.script = None
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )


def test_tokenize_renders_as_auto_chat_does(served, tok):
    url = served[2]
    body = {"model": "fake-base", "messages": HISTORY, "tools": [WEATHER]}
    r = httpx.post(url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    shown = TemplateTools(False, "hermes").messages(HISTORY, [WEATHER], show=True)
    assert r.json()["tokens"] == rendered(tok, shown)
