"""Result value types, shaped as vLLM's: Logprob, CompletionOutput, RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from ort_lora.lora_request import LoRARequest

# One position's logprobs: token id -> Logprob (the top-k plus the sampled / actual token).
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    """logprob: log-softmax of the raw logits; rank: 1 = most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the request's n completions.

    finish_reason: "stop" (eos, stop string or stop token), "length" (max_tokens or context),
    "abort", or None while running. stop_reason: the stop string or stop token id that ended
    it, None for eos or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request, returned (or streamed) by the engine.

    prompt_logprobs: None unless asked for; else one entry per prompt token, the first None
    (nothing predicts it), then a dict that always holds the actual prompt token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    lora_request: LoRARequest | tuple[LoRARequest, ...] | None = None  # tuple: composed
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
