"""RequestState: the engine's view of one user request (n completions), turned into vLLM's
RequestOutput. Each completion is one scheduler Sequence with id "<request_id>#<index>".

Per completion it keeps the incremental detokenizer (stop strings held back), the logprobs,
the cumulative logprob and the finish reason; per request the prompt logprobs (first None).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ort_lora.engine.sampler import make_generator
from ort_lora.engine.sequence import Sequence
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ort_lora.sampling_params import SamplingParams
from ort_lora.tokenizer import IncrementalDetokenizer


def seq_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class Completion:
    """One of the request's n completions, as the engine builds it token by token."""

    index: int
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: np.random.Generator | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text,
            token_ids=list(self.seq.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    completions: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @classmethod
    def create(cls, request_id, prompt, prompt_ids, params, lora_request, seqs, tokenizer):
        state = cls(request_id, prompt, list(prompt_ids), params, lora_request)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        want_lp = params.logprobs is not None
        for i, seq in enumerate(seqs):
            gen = make_generator(params)
            if gen is not None and i:
                gen = np.random.default_rng([params.seed, i])  # distinct, reproducible streams
            detok = IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
            )
            lp = [] if want_lp else None
            state.completions.append(Completion(i, seq, detok, gen, lp, 0.0 if want_lp else None))
        return state

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[c.output() for c in self.completions],
            finished=self.finished,
            lora_request=self.lora_request,
        )
