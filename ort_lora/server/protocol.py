"""Request bodies of the OpenAI-compatible API (OpenAI's field names and ranges, plus vLLM's
extra sampling fields), and their mapping to SamplingParams.

Every field is bounded here, so that no value can reach the engine thread and fail there:
integers to what the engine holds (int64; seeds 0 .. 2^64 - 1, as vLLM), floats finite,
strings valid Unicode (no lone surrogates, anywhere in the body), sizes capped. Validation
gives 400s that name the field; SamplingParams checks the same ranges again (the offline
API's entry). Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ort_lora.sampling_params import MAX_INT, MAX_SEED, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 16
# chat_template_kwargs the renderer sets itself (or Jinja's render takes): refused by name
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "template", "self", "tools", "documents"}
)

Int = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
TokenIds = list[Annotated[int, Field(ge=0, le=MAX_INT)]]


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string (value or key) in `value` that holds a lone surrogate
    (not encodable text: JSON's "\\ud800" escapes allow them), or None."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(v, dict):
            stack += [(k, f"{at}.<key>") for k in v] + [(x, f"{at}.{k}") for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(x, f"{at}[{i}]") for i, x in enumerate(v)]
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _lone_surrogate(data, "body")
        if bad is not None:
            raise ValueError(f"{bad} holds a lone UTF-16 surrogate: not valid Unicode text")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=1024)
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
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return value

    def sampling_kwargs(self) -> dict:
        names = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty")
        names += ("frequency_penalty", "top_k", "min_p", "repetition_penalty", "ignore_eos")
        names += ("stop_token_ids", "skip_special_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
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

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            **self.sampling_kwargs(), max_tokens=max_tokens, logprobs=self.logprobs
        )


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value):
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(value or ()))
        if taken:
            raise ValueError(f"{taken} are set by the server, not by chat_template_kwargs")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self.sampling_kwargs(), max_tokens=max_tokens, logprobs=logprobs)


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
