"""What a request asks its output to be, and tool calls read back out of the output.

`output_spec(req, tool_parser)` turns OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, and tool_choice into the engine's StructuredOutputs (at most one source; the
field it came from is named in errors). Tools (chat only), as vLLM does them:
  "required"        the output is a JSON array of {"name", "parameters"} calls, one of the
                    tools each (the grammar enforces it), read back as tool_calls (the
                    complete ones, should max_tokens cut the array short)
  a named function  the output is that function's arguments (its parameters schema)
  "auto"            free text; a tool-call parser reads the calls the model chose to write:
                    --tool-call-parser, else the one the chat template implies
                    (tool_prompt.py); with none, a 400 naming the flag
  "none"            tools are rendered by the chat template; nothing is parsed
The model's own chat template decides how tools are shown to it; one that ignores them gets
them written into the system prompt (tool_prompt.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

from ort_lora.sampling_params import StructuredOutputs
from ort_lora.server.errors import bad_request

TOOL_PARSERS = ("hermes",)  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, SmolLM2)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class OutputSpec:
    """The engine's constraint and how to read tool calls out of the output."""

    structured: StructuredOutputs | None = None
    param: str | None = None  # the request field the constraint came from
    tool_mode: str | None = None  # "required", "named", "auto" (with a parser), or None
    named: str | None = None  # the function of a named tool_choice
    tools: list[dict] = field(default_factory=list)  # as the chat template sees them


def output_spec(req, tool_parser: str | None = None) -> OutputSpec:
    """The request's output constraint (400 naming the field when it asks for two, or for
    tools in a way this server cannot serve)."""
    sources = _constraint_sources(req)
    spec = _tool_spec(req, tool_parser)
    if spec.structured is not None:
        sources.append((spec.param, spec.structured))
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise bad_request(f"at most one output constraint per request, got {names}", names[1])
    if sources:
        spec.param, structured = sources[0]
        spec.structured = replace(structured, source=spec.param)  # its errors name the field
    return spec


def _constraint_sources(req) -> list[tuple[str, StructuredOutputs]]:
    out = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ or {"type": "object"}
        strict = bool(rf.json_schema.strict)
        out.append(("response_format", StructuredOutputs(json=schema, strict=strict)))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kwargs = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        spec = _structured(kwargs, bool(so.json_object), "structured_outputs")
        out.append(("structured_outputs", spec))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice,
              "grammar": req.guided_grammar}  # fmt: skip
    for key, value in guided.items():
        if value is not None:
            out.append((f"guided_{key}", _structured({key: value}, False, f"guided_{key}")))
    return out


def _structured(kwargs: dict, json_object: bool, param: str) -> StructuredOutputs:
    from ort_lora.errors import RequestError

    try:
        return StructuredOutputs(json_object=json_object, **kwargs)
    except RequestError as exc:
        raise bad_request(str(exc), param) from exc


def _tool_spec(req, tool_parser: str | None) -> OutputSpec:
    tools = getattr(req, "tools", None) or []
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return OutputSpec()
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"tools have duplicate names: {names}", "tools")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return OutputSpec(tools=rendered)
    if choice == "auto":
        if tool_parser is None:
            raise bad_request(
                'tool_choice "auto" needs a tool-call parser, and this chat template shows '
                "tools in a format none here reads: start the server with --tool-call-parser "
                "(one of: " + ", ".join(TOOL_PARSERS) + ") if the model writes its calls so",
                "tool_choice",
            )
        return OutputSpec(tool_mode="auto", tools=rendered)
    if choice == "required":
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(t) for t in tools]},
        }
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        spec = StructuredOutputs(json=calls, strict=any(t.function.strict for t in tools))
        return OutputSpec(spec, "tool_choice", "required", None, rendered)
    named = choice.function.name
    if named not in names:
        message = f"tool_choice names {named!r}, which is not in tools {names}"
        raise bad_request(message, "tool_choice")
    function = tools[names.index(named)].function
    params = function.parameters or {"type": "object"}
    spec = StructuredOutputs(json=params, strict=bool(function.strict))
    return OutputSpec(spec, "tool_choice", "named", named, rendered)


def _call_schema(tool) -> dict:
    params = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def tool_calls(spec: OutputSpec, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls in OpenAI's shape) read out of a finished output's text."""
    if spec.tool_mode == "named":
        return None, [new_call(spec.named, text)]
    if spec.tool_mode == "required":
        calls = _complete_items(text)
        if not calls:
            return text, []  # cut short (max_tokens) inside the first call
        return None, [new_call(c["name"], json.dumps(c["parameters"])) for c in calls]
    if spec.tool_mode == "auto":
        return _hermes(text)
    return text, []


def _complete_items(text: str) -> list:
    """The complete items of a JSON array, even if the text was cut short after them (the
    grammar made every item valid; max_tokens may end the array before its "]")."""
    decoder, items, at = json.JSONDecoder(), [], 1
    if not text.startswith("["):
        return items
    while at < len(text):
        try:
            item, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # nested too deeply for the decoder: not an item
            break
        items.append(item)
        if text[at : at + 1] != ",":
            break
        at += 1
        while text[at : at + 1] in (" ", "\t", "\n", "\r"):  # the grammar writes ", "
            at += 1
    return items


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's output in the Hermes format; output with a block that is
    not a well-formed call (JSON nested too deeply for the decoder included) is all content."""
    calls = []
    for block in _hermes_blocks(text):
        try:
            call = json.loads(block)
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return text, []
            calls.append(new_call(call["name"], json.dumps(call.get("arguments", {}))))
        except (ValueError, RecursionError):
            return text, []
    if not calls:
        return text, []
    content = text[: text.index(HERMES_OPEN)].strip()
    return content or None, calls


def _hermes_blocks(text: str) -> list[str]:
    """The text inside each <tool_call>...</tool_call>, stripped (one linear scan: a regex
    would rescan the rest of the output from every unclosed tag)."""
    blocks, at = [], 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            break
        blocks.append(text[start + len(HERMES_OPEN) : end].strip())
        at = end + len(HERMES_CLOSE)
    return blocks


def new_call(name: str, arguments: str) -> dict:
    """One tool call in OpenAI's shape, with a fresh id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def streamable_text(spec: OutputSpec, text: str, final: bool) -> str:
    """The part of the output text a stream may send as content now: none for required and
    named tool calls (a named call streams as its arguments; required calls are sent whole at
    the end), up to the first "<tool_call>" (or a possible start of one) with a parser."""
    if spec.tool_mode in ("required", "named"):
        return ""
    if spec.tool_mode != "auto":
        return text
    if HERMES_OPEN in text:
        return text[: text.index(HERMES_OPEN)]
    if final:
        return text
    for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(HERMES_OPEN[:n]):
            return text[:-n]
    return text
