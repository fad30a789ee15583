"""The request body of OpenAI's Responses API (POST /v1/responses), and its translation into
a chat completion request: the Responses API runs on the chat path (templates, tools,
structured outputs, sampling), never on one of its own.

    input text                      -> a user message
    instructions                    -> a system message in front
    message items (user, system,    -> messages; input_text / output_text / refusal parts
      developer, assistant)            joined into their text
    function_call items             -> tool_calls of an assistant message (the one just
                                       before, if it is the assistant's)
    function_call_output items      -> tool messages (call_id -> tool_call_id)
    tools (function), tool_choice   -> tools, tool_choice ({"type": "function", "name"} ->
                                       {"type": "function", "function": {"name"}})
    text.format                     -> response_format (json_schema, json_object)
    max_output_tokens               -> max_completion_tokens

The server keeps no state: a response is never stored, so `store: true`,
`previous_response_id` and `conversation` are 400s that say to send the whole conversation in
`input` (a Ray deployment's ingress replicas would not share a store anyway). Fields of the
API this server does not implement are 400s naming them (REFUSED), unknown ones as on the
other routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from ort_lora.sampling_params import MAX_INT
from ort_lora.server.errors import APIError, bad_request
from ort_lora.server.limits import MAX_MESSAGES, MAX_TOOLS
from ort_lora.server.protocol import AdapterTerm, ChatCompletionRequest
from ort_lora.server.protocol_fields import Name, Source, _Request

NO_STATE = "this server stores no responses: send the whole conversation in `input`"
# Fields of the Responses API this server does not implement: (accepted values, why not)
REFUSED: dict[str, tuple[tuple, str]] = {
    "store": ((None, False), f"true is not supported; {NO_STATE} (store false)"),
    "previous_response_id": ((None,), f"not supported; {NO_STATE}"),
    "conversation": ((None,), f"not supported; {NO_STATE}"),
    "background": ((None, False), "background responses are not supported"),
    "prompt": ((None,), "prompt templates are not supported: send instructions and input"),
    "reasoning": ((None, {}), "reasoning options are not supported by this server"),
    "max_tool_calls": ((None,), "not supported"),
    "top_logprobs": ((None, 0), "not supported on /v1/responses"),
    "truncation": ((None, "disabled"), 'only "disabled" is supported'),
    "service_tier": (
        (None, "auto", "default"),
        'service tiers are not supported ("auto" or "default" only)',
    ),  # fmt: skip
    "context_management": ((None,), "not supported"),
    "prompt_cache_retention": ((None,), "not supported"),
}
# `include` values accepted: encrypted reasoning, which this server never produces
INCLUDABLE = ("reasoning.encrypted_content",)
ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "refusal")
MAX_PARTS = 1024
MAX_METADATA = 16


class ContentPart(_Request):
    """A text part of a message (an output_text part replayed from an earlier response
    keeps its annotations and logprobs, which are ignored)."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    logprobs: list | None = None

    @model_validator(mode="after")
    def _has_text(self):
        key = "refusal" if self.type == "refusal" else "text"
        if getattr(self, key) is None:
            raise ValueError(f"a {self.type} part needs {key}")
        return self

    @property
    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


def _text_parts(value, path: str):
    """Before validation: a part of a type other than text is a 400 that says so."""
    if not isinstance(value, list):
        return value
    if len(value) > MAX_PARTS:
        raise ValueError(f"{len(value)} content parts; at most {MAX_PARTS}")
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in PART_TYPES:
            raise ValueError(
                f"{path}[{j}] has type {kind[:40]!r}: this server takes text only "
                f"({', '.join(PART_TYPES)})"
            )
    return value


def _text_or_parts(value) -> str:
    return "text" if isinstance(value, str) else "parts"


Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_text_or_parts),
]


def _joined(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.value for p in content)


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a replayed output's: no effect

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        return _text_parts(value, "content")


class FunctionCallItem(_Request):
    """A call the model made in an earlier response."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    """The result of a call, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Content
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, value):
        return _text_parts(value, "output")


def _item_type(value) -> str | None:
    """An item's tag; a message may come without one (EasyInputMessage)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: Annotated[dict | None, Source] = None
    strict: bool | None = None


class FunctionChoice(_Request):
    type: Literal["function"]
    name: Name


class TextFormat(_Request):
    """text.format: plain text, any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: str | None = None
    schema_: Annotated[dict | None, Source] = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; "low" and "high" are not served


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None  # nothing is obfuscated: accepted, no effect


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = Field(None, max_length=1024)
    # ort-lora's extra (as on the chat route): compose adapters, each weighted
    adapters: list[AdapterTerm] | None = Field(None, max_length=64)
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items"),  # one branch's errors
    ]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = Field(None, max_length=16)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    # identifiers of the end user or of a prompt prefix: accepted, they change nothing here
    # (prefix caching needs no key)
    user: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)
    prompt_cache_key: str | None = Field(None, max_length=512)
    # REFUSED: any value but the accepted ones is a 400 naming the field
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    service_tier: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refused(cls, value, info):
        accepted, why = REFUSED[info.field_name]
        if isinstance(value, dict) and value and all(v is None for v in value.values()):
            value = {}  # e.g. reasoning {"effort": null}: nothing asked
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise ValueError(why)
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value):
        if not isinstance(value, list):
            return value
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"{len(value)} items; at most {MAX_MESSAGES}")
        if not value:
            raise ValueError("must not be empty")
        for i, item in enumerate(value):
            kind = _item_type(item)
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise ValueError(
                    f"input[{i}] has type {kind[:40]!r}: this server takes items of type "
                    f"{', '.join(ITEM_TYPES)}"
                )
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value):
        for name in value or ():
            if name not in INCLUDABLE:
                raise ValueError(f"{name[:60]!r} cannot be included (only {list(INCLUDABLE)})")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is not None and len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} entries, got {len(value)}")
        return value


# Chat fields -> the Responses fields they came from, for the errors of the chat path
CHAT_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `req` (400 naming the Responses field for a
    function_call_output with no call before it)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
    }
    if req.adapters is not None:
        body["adapters"] = [a.model_dump() for a in req.adapters]
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = _chat_format(fmt)
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # the Responses models check as much: a server fault
        raise bad_request(f"the request does not translate to a chat request: {exc}") from exc


def _chat_tool(tool: FunctionTool) -> dict:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_format(fmt: TextFormat) -> dict:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    schema |= {k: getattr(fmt, k) for k in ("description", "strict") if getattr(fmt, k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages (dicts, validated by ChatCompletionRequest)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    names: dict[str, str] = {}  # call_id -> function name, of the calls seen so far
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in names:
                raise APIError(
                    400,
                    f"input[{i}]: no function_call with call_id {item.call_id[:80]!r} before "
                    f"this function_call_output; {NO_STATE}",
                    param=f"input[{i}].call_id",
                )
            name, content = names[item.call_id], _joined(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": name,
                             "content": content})  # fmt: skip
    return messages


def renamed(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses field its chat field came from."""
    if error.param in CHAT_PARAMS:
        old, error.param = error.param, CHAT_PARAMS[error.param]
        error.message = error.message.replace(old, error.param, 1)
    return error
