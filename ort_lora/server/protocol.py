"""Request bodies of OpenAI's completions and chat completions (OpenAI's field names and
ranges, plus vLLM's extra sampling fields), and their mapping to SamplingParams.

The bounds and checks every field is held to are protocol_fields.py's: strict types, int64
integers, finite floats, valid Unicode, capped sizes; validation gives 400s that name the
field, and SamplingParams checks the same ranges again (the offline API's entry).

Fields the OpenAI API or vLLM defines that ort-lora does not implement are refused with a 400
naming them (protocol_fields.UNSUPPORTED); unknown fields too (they land in `model_extra`:
serving.py refuses them unless the server runs with --allow-unknown-fields). OpenAI's chat
fields that do not change what is generated (store, metadata, service_tier, prompt caching,
safety_identifier, user) are accepted, checked and without effect (`_NoEffectFields`).
docs/API.md has the table. vLLM's own endpoints' bodies are protocol_vllm.py's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ort_lora.errors import RequestError
from ort_lora.sampling_params import MAX_INT, MAX_SEED, SamplingParams
from ort_lora.server.limits import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)
from ort_lora.server.protocol_fields import (
    MAX_METADATA,
    MAX_N,
    RESERVED_TEMPLATE_KWARGS,
    TOKEN_ID_KEY,
    MetadataKey,
    MetadataValue,
    Name,
    Source,
    TokenIds,
    TopLogprobs,
    _Request,
)

NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "echo"})


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
