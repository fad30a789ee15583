"""Tools for chat templates that do not show them, and the tool-call parser a template implies.

A chat template decides how the model sees `tools`, its earlier calls and their results. Many
(SmolLM2's among them) ignore all three: rendered with tools or without, the prompt is the
same, and a model asked for tool_choice "auto" never learns that the tools exist. For such a
template the server writes them in itself, in the Hermes format the "hermes" parser reads
(Qwen2.5's wording), before the template renders the messages:

    system     its own text (if any), then "# Tools", the tools as JSON lines inside
               <tools></tools>, and how to call one: <tool_call>{"name", "arguments"}</tool_call>
    assistant  earlier calls as <tool_call> blocks after its text
    user       tool results as <tool_response> blocks (consecutive results in one turn)

`ToolPrompting.for_template(source)` finds out which kind a template is by rendering a probe
conversation with and without a probe tool (once per template, cached). The answer also
picks the parser a server uses when --tool-call-parser is not given: "hermes" for a template
that ignores tools (the server writes that format) or writes <tool_call> itself (Qwen2,
Qwen3, Hermes); none for one that shows tools in another format, whose "auto" calls no
parser here can read.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ort_lora.server.structured import HERMES_CLOSE, HERMES_OPEN
from ort_lora.tokenizer import ChatTemplateError

MAX_CACHED_TEMPLATES = 64
PROBE_NAME = "ort_lora_probe_tool"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
PROBE_MESSAGES = [{"role": "user", "content": "hi"}]
HERMES_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools."""

    shows_tools: bool  # it renders `tools` itself (and, it is assumed, calls and results)
    parser: str | None  # the tool-call parser its format matches; None: none here does

    def messages(self, messages: list[dict], tools: list[dict], show: bool) -> list[dict]:
        """`messages` (template dicts) as the template should get them: unchanged when it
        shows tools; else calls and results written as Hermes text, and with `show` the
        tools in the system prompt."""
        if self.shows_tools:
            return messages
        out = _fold_calls(messages)
        return _with_tools(out, tools) if show and tools else out


def _fold_calls(messages: list[dict]) -> list[dict]:
    """Assistant calls as <tool_call> blocks after the text; tool results as one user turn
    of <tool_response> blocks per run of consecutive results."""
    out: list[dict] = []
    results = False  # whether out[-1] is a turn of tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:
                out[-1] = out[-1] | {"content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_block(c) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(m)
    return out


def _call_block(call: dict) -> str:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):  # not JSON: shown as the string it is
        arguments = function["arguments"]
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def _with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools block at the end of the leading system message (a new one if none)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block = f"{HERMES_TOOLS_INTRO}\n{lines}\n{HERMES_TOOLS_OUTRO}"
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first | {"content": text}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def probe(tokenizer, source: str) -> TemplateTools:
    """What `source` does with tools: rendered with a probe tool and without."""
    hermes = "hermes" if HERMES_OPEN in source else None
    try:
        plain = tokenizer.apply_chat_template(PROBE_MESSAGES, True, source)
        with_tool = tokenizer.apply_chat_template(PROBE_MESSAGES, True, source, tools=[PROBE_TOOL])
    except ChatTemplateError:  # it fails on the probe: leave tools to it, as before
        return TemplateTools(True, hermes)
    if PROBE_NAME in with_tool and PROBE_NAME not in plain:
        return TemplateTools(True, hermes)
    return TemplateTools(False, "hermes")


class ToolPrompting:
    """TemplateTools per chat template, probed once and cached (an LRU of
    MAX_CACHED_TEMPLATES, keyed by a digest: a request's template may be large)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, TemplateTools] = OrderedDict()

    def for_template(self, source: str | None) -> TemplateTools:
        """`source`, or the model's template when None; a model without one: left alone."""
        source = source or getattr(self.tokenizer, "chat_template", None)
        if not source:
            return TemplateTools(True, None)
        key = hashlib.sha256(source.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        found = probe(self.tokenizer, source)  # outside the lock: a render takes time
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > MAX_CACHED_TEMPLATES:
                self._cache.popitem(last=False)
        return found
