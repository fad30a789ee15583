"""Request bodies of the OpenAI-compatible API (OpenAI's field names and ranges, plus vLLM's
extra sampling fields), and their mapping to SamplingParams.

Every field is bounded here, so that no value can reach the engine thread and fail there:
integers to what the engine holds (int64; seeds 0 .. 2^64 - 1, as vLLM), floats finite,
strings valid Unicode (no lone surrogates, anywhere in the body), sizes capped (limits.py:
lists by `max_length`, constraint sources by MAX_CONSTRAINT_CHARS). Types are strict: a
number field takes a JSON number (an integer field an integer), never `true` or `"1"`.
Validation gives 400s that name the field; SamplingParams checks the same ranges again (the
offline API's entry).

Fields the OpenAI API or vLLM defines that ort-lora does not implement are refused with a 400
naming them (UNSUPPORTED); unknown fields too (they land in `model_extra`: serving.py refuses
them unless the server runs with --allow-unknown-fields). OpenAI's chat fields that do not
change what is generated (store, metadata, service_tier, prompt caching, safety_identifier,
user) are accepted, checked and without effect (`_NoEffectFields`). docs/API.md has the table.

A check across fields raises RequestError (a ValueError) with the field it names: its `param`
reaches the 400 (errors.py), which never repeats the body.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from ort_lora.errors import RequestError
from ort_lora.sampling_params import MAX_INT, MAX_SEED, SamplingParams
from ort_lora.server.limits import (
    MAX_CONSTRAINT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)

MAX_TOP_LOGPROBS = 20
MAX_N = 16
NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "echo"})
TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit takes "١٢")
# chat_template_kwargs the renderer sets itself (or Jinja's render takes): refused by name
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "template", "self", "tools", "documents"}
)

Int = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
TokenIds = list[Annotated[int, Field(ge=0, le=MAX_INT)]]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA = 16
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


def _constraint_chars(value) -> int:
    """A constraint's size as the grammar compiler reads it: a schema's characters as JSON
    text (about: separators are counted once), a regex or grammar, choices together. Counted
    only up to just past MAX_CONSTRAINT_CHARS, in Python (the event loop gets the GIL
    between steps; json.dumps of a 4 MiB schema would hold it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value)
    total, stack = 0, [value]
    while stack and total <= MAX_CONSTRAINT_CHARS:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            total += 2 + len(v)
            stack += v
        else:
            total += 4  # a number, true, false or null
    return total


def _bounded_constraint(value):
    size = _constraint_chars(value)
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"over {size - 1} characters; a constraint (JSON schema as JSON text, regex, grammar, "
            f"choices) may have at most {MAX_CONSTRAINT_CHARS}"
        )
    return value


# The source of a structured-output constraint (its compile time grows with its size)
Source = AfterValidator(_bounded_constraint)
# Fields of the OpenAI API / vLLM that ort-lora does not implement: any value but these is a
# 400 naming the field (never silently dropped).
UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None, "none"),
    "verbosity": (None, "medium"),
    "moderation": (None,),
    "web_search_options": (None,),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "return_tokens_as_token_ids": (None, False),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string (value or key) in `value` that holds a lone surrogate
    (not encodable text: JSON's "\\ud800" escapes allow them), or None. Paths are built
    only for the hit: a body may hold a million numbers."""
    stack = [(value, (path,))]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return "".join(_flatten(at))
        elif isinstance(v, dict):
            stack += [(k, (at, ".<key>")) for k in v if not _encodable(k)]
            stack += [(x, (at, f".{k}")) for k, x in v.items() if _walked(x)]
        elif isinstance(v, list) and not set(map(type, v)) <= _SCALARS:  # token ids: skipped
            stack += [(x, (at, i)) for i, x in enumerate(v) if _walked(x)]
    return None


_SCALARS = {int, float, bool, type(None)}


def _walked(value) -> bool:
    return isinstance(value, str | dict | list)


def _encodable(text) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _flatten(at) -> list[str]:
    parts = []
    while isinstance(at, tuple) and len(at) == 2:
        at, last = at
        parts.append(f"[{last}]" if isinstance(last, int) else last)
    return [at[0] if isinstance(at, tuple) else at, *reversed(parts)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _lone_surrogate(data, "body")
        if bad is not None:
            field = re.match(r"body\.([^.\[<]+)", bad)  # the top-level field it lies in
            raise RequestError(
                f"{bad} holds a lone UTF-16 surrogate: not valid Unicode text",
                field and field.group(1),
            )
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's; no effect: chunks carry no padding field
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk too


class JsonSchemaFormat(_Request):
    name: Name = "response"
    description: str | None = None
    schema_: Annotated[dict | None, Source] = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format. `{"type": "json_object", "schema": {...}}` (instructor's
    JSON_SCHEMA mode, also taken by vLLM and llama.cpp) becomes that json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: Annotated[dict | None, Source] = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise RequestError("type json_schema needs a json_schema object", "response_format")
        if self.schema_ is not None:
            if self.type != "json_object":
                raise RequestError(
                    f"goes with type json_object, not {self.type}; with json_schema give "
                    "json_schema.schema",
                    "response_format.schema",
                )
            self.type = "json_schema"
            self.json_schema = JsonSchemaFormat.model_validate({"schema": self.schema_})
        return self


class StructuredOutputsField(_Request):
    """vLLM's structured_outputs (one of json, regex, choice, grammar, json_object)."""

    json_: Annotated[dict | str | None, Source] = Field(None, alias="json")
    regex: Annotated[str | None, Source] = None
    choice: Annotated[list[str] | None, Source] = None
    grammar: Annotated[str | None, Source] = None
    json_object: bool | None = None


class FunctionDef(_Request):
    name: Name
    description: str | None = None
    parameters: Annotated[dict | None, Source] = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Name


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class AdapterTerm(_Request):
    """One adapter of a composed request (`adapters`): its name and weight (finite)."""

    name: str = Field(min_length=1, max_length=128)
    weight: float = 1.0


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=1024)
    # ort-lora's extra (an extra_body field for OpenAI clients): compose adapters, each
    # weighted; `model` is then omitted, the base model's name, or the names joined by "+"
    adapters: list[AdapterTerm] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    prompt_logprobs: TopLogprobs | None = None
    # structured outputs (OpenAI's response_format; vLLM's structured_outputs and guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Annotated[dict | str | None, Source] = None
    guided_regex: Annotated[str | None, Source] = None
    guided_choice: Annotated[list[str] | None, Source] = None
    guided_grammar: Annotated[str | None, Source] = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value):
        for key in value or {}:
            if not TOKEN_ID_KEY.fullmatch(key) or int(key) > MAX_INT:
                raise ValueError(f"keys must be token ids (ASCII digits), got {key[:20]!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI's n, stream, logprobs and echo may be null: their default."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise RequestError("only allowed with stream: true", "stream_options")
        return self

    def sampling_kwargs(self) -> dict:
        names = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty")
        names += ("frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos")
        names += ("stop_token_ids", "skip_special_tokens", "prompt_logprobs")
        names += ("include_stop_str_in_output",)
        kwargs = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:
            kwargs["logit_bias"] = {int(t): b for t, b in self.logit_bias.items()}
        return kwargs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. max_tokens 0: nothing is generated (with echo: the prompt, and
    with logprobs its tokens' logprobs, as lm-evaluation-harness asks)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT)
    logprobs: TopLogprobs | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and (not value or any(p == [] for p in value)):
            raise ValueError("prompt must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group: a str, or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def sampling_params(self, max_tokens: int | None, **extra) -> SamplingParams:
        """echo with logprobs asks for the prompt's logprobs too (vLLM's rule)."""
        kwargs = self.sampling_kwargs() | extra
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = self.logprobs
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=self.logprobs)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply to that call

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return message


class _ChatRendering(_Request):
    """How chat messages become a prompt (vLLM's extras; chat completions and /tokenize)."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value):
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(value or ()))
        if taken:
            raise ValueError(f"{taken} are set by the server, not by chat_template_kwargs")
        return value


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: str = Field("30m", max_length=16)


class _NoEffectFields(_Request):
    """OpenAI's chat fields that do not change what is generated: accepted, checked as
    OpenAI documents them, and without effect here. Nothing is stored (`store`, `metadata`),
    there is one service tier, and the prefix cache finds shared prefixes by their tokens
    (no key, options or retention policy needed)."""

    store: bool | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=MAX_METADATA)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = Field(None, max_length=128)


class ChatCompletionRequest(_SamplingFields, _ChatRendering, _NoEffectFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("needs logprobs: true", "top_logprobs")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, max_tokens: int | None, **extra) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kwargs = self.sampling_kwargs() | extra
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("a path cannot hold a NUL byte")
        return value


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and ignored)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: Int | None = None


class TokenizeRequest(_ChatRendering):
    """POST /tokenize (vLLM's body): a prompt, or chat messages rendered as a chat request's."""

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's body)."""

    model: str | None = Field(None, max_length=1024)
    tokens: TokenIds
