"""SamplingParams: per-request decoding settings, vLLM's names, defaults and valid ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ort_lora.errors import RequestError

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5
MAX_SEED = 2**64 - 1  # numpy's generators take seeds in [0, 2^64), as vLLM's API bounds them
MAX_INT = 2**63 - 1  # every other integer must fit the int64 the sampler holds it in


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must be (vLLM's StructuredOutputsParams): exactly one of
    json (a JSON schema, dict or string), regex, choice (one of these strings), grammar (a
    Lark grammar, llguidance's dialect; GBNF is converted) or json_object (any JSON object).
    strict=False compiles a JSON schema leniently (unsupported keywords ignored, as the
    OpenAI API's strict: false allows); strict=True refuses what cannot be enforced.
    source: the request field it came from (response_format, guided_json, tool_choice, ...),
    which its errors name; not part of what it constrains."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = True
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar or "
                f"json_object; got {given or 'none'}",
                "structured_outputs",
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise RequestError("choice must be a non-empty list of non-empty strings", "choice")
            object.__setattr__(self, "choice", tuple(self.choice))


@dataclass
class SamplingParams:
    """Decoding settings of one request (fields and ranges as vLLM's SamplingParams).

    temperature 0 is greedy. top_k -1 or 0 disables top-k. stop accepts a string or a list and
    is normalized to a list. logprobs / prompt_logprobs: how many top tokens to return per
    position (the sampled / actual token is always included too); None = none returned.
    Logprobs are the log-softmax of the raw model logits (vLLM's default "raw_logprobs").
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        self._check_ints()
        self._check_floats()
        self._normalize()
        self._check_stops()
        self._check_logit_bias()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)

    def _normalize(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise RequestError(
                f"stop must be a string or a list of strings, got {self.stop!r}", "stop"
            )
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise RequestError(
                f"stop_token_ids must be a list of token ids, got {ids!r}", "stop_token_ids"
            )
        self.stop_token_ids = list(ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.is_greedy:
            # As vLLM: greedy ignores the truncation settings.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _check_ints(self):
        _check_int("n", self.n, 1)
        _check_int("top_k", self.top_k, -1, hint="-1 or 0 (disabled) or >= 1")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)

    def _check_floats(self):
        _check_range("temperature", self.temperature, 0.0, None, "must be >= 0")
        _check_range("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]", low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _check_range(
            "repetition_penalty", self.repetition_penalty, 0.0, None, "must be > 0", low_open=True
        )

    def _check_stops(self):
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must hold non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, 0)

    def _check_logit_bias(self):
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}",
                               "logit_bias")  # fmt: skip
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias[]", token, 0)
            _check_range("logit_bias", bias, -100.0, 100.0, "must be in [-100, 100]")
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(
    name: str, value, low: int | None, high: int = MAX_INT, hint: str | None = None
) -> None:
    param = name.removesuffix("[]")
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", param)
    if low is not None and value < low:
        raise RequestError(f"{name} must be {hint or f'>= {low}'}, got {value}", param)
    if value > high:
        raise RequestError(f"{name} must be <= {high}, got {value}", param)


def _check_range(name, value, low, high, rule: str, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", name)
    below = value <= low if low_open else value < low
    if below or (high is not None and value > high):
        raise RequestError(f"{name} {rule}, got {value}", name)
