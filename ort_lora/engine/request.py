"""Requests as the engine sees them: checked once at entry, tracked until they finish.

A request has n completions; completion i is one scheduler Sequence with completion id
"<request_id>#<i>". `check_request` is the one validation of a request (the server maps its
RequestError to HTTP 400). `RequestTracker` owns the unfinished requests and the ONE path by
which a completion finishes, however it ends (stop rule or length in the scheduler, abort,
a failed adapter): `_finish` flushes its text, gives its adapter back to the registry and
retires the request once every completion is done. The finish reason is stored once, as the
sequence's status (FINISHED_STOPPED / _LENGTH / _ABORTED), with its stop_reason beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ort_lora.adapters.errors import AdapterError
from ort_lora.adapters.registry import AdapterRegistry
from ort_lora.engine.grammar import Constraint
from ort_lora.engine.sampler import SampleRow, make_generator, prompt_logprobs
from ort_lora.engine.scheduler import Scheduler
from ort_lora.engine.sequence import Sequence as Seq
from ort_lora.errors import RequestError, internal_error
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ort_lora.sampling_params import SamplingParams
from ort_lora.tokenizer import IncrementalDetokenizer

NOT_STOPPED = object()  # Completion.add_token: the new token does not end the completion


def completion_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def decorated(lp: PositionLogprobs, tokenizer) -> PositionLogprobs:
    """The entry with each token's text (decoded_token) filled in."""
    for token, entry in lp.items():
        entry.decoded_token = tokenizer.token_text(token)
    return lp


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context, the pool."""

    vocab_size: int  # rows of the embedding: prompt ids must be below
    max_model_len: int  # prompt + output tokens
    block_size: int  # tokens per KV page
    num_pages: int  # pages in the pool (KV and adapters together)


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, adapter_pages: int, limits: RequestLimits
) -> int:
    """The request's max_tokens (params.max_tokens, or what the context leaves); RequestError
    naming the problem if it can never be served. The one place requests are validated."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; expected at least one token", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})",
            "prompt",
        )
    n, limit, asked = len(prompt_ids), limits.max_model_len, params.max_tokens
    if n >= limit:  # the prompt alone leaves no room: its fault, whatever max_tokens says
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, the prompt has "
            f"{n} tokens, which leaves no room for the completion. Please reduce the prompt.",
            "prompt",
        )
    if asked is not None and n + asked > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + asked} tokens ({n} in the prompt, {asked} in the completion). "
            "Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
    beyond = [t for t in params.logit_bias or () if t >= limits.vocab_size]
    if beyond:
        raise RequestError(
            f"logit_bias token ids {beyond[:5]} are outside the vocabulary "
            f"[0, {limits.vocab_size})",
            "logit_bias",
        )
    max_tokens = limit - n if asked is None else asked
    kv_pages = -(-(n + max_tokens) // limits.block_size)
    if kv_pages + adapter_pages > limits.num_pages:
        # the prompt and one token already too many: the prompt's fault, else max_tokens'
        alone = -(-(n + 1) // limits.block_size) + adapter_pages > limits.num_pages
        param = "prompt" if alone else "max_tokens"
        raise RequestError(
            f"prompt + max_tokens = {n + max_tokens} tokens need {kv_pages} KV pages + "
            f"{adapter_pages} adapter pages, more than the pool's {limits.num_pages} pages; "
            f"{'shorten the prompt' if alone else 'lower max_tokens'} or grow the pool",
            param,
        )
    return max_tokens


@dataclass
class Completion:
    """One of the request's n completions, as the engine builds it token by token."""

    index: int
    seq: Seq
    detok: IncrementalDetokenizer
    generator: np.random.Generator | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    constraint: Constraint | None = None  # its structured output's grammar state
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (token ids, biases)

    @property
    def finish_reason(self) -> str | None:
        return self.seq.status.finish_reason

    def add_token(self, token: int, eos_token_ids: Sequence[int]):
        """Detokenize the sampled token and apply the stop rules: a stop string (found and cut
        by the detokenizer), EOS (unless ignore_eos), a stop token id, the end of its grammar.
        Returns the stop reason (the string, the token id, None for EOS or a complete
        grammar) or NOT_STOPPED. Length limits are the scheduler's."""
        params = self.seq.sampling_params
        self.detok.add(token)
        grammar_done = self.constraint is not None and self.constraint.advance(token)
        if self.detok.stopped is not None:
            return self.detok.stopped
        if not params.ignore_eos and token in eos_token_ids:
            return None
        if token in params.stop_token_ids:
            return token
        return None if grammar_done else NOT_STOPPED

    def sample_row(self) -> SampleRow:
        seq = self.seq
        return SampleRow(
            seq.sampling_params,
            seq.prompt_token_ids,
            seq.output_token_ids,
            self.generator,
            self.bias,
        )

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text,
            token_ids=list(self.seq.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.seq.stop_reason,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | tuple[LoRARequest, ...] | None  # a tuple: a composition
    completions: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @classmethod
    def create(
        cls, request_id, prompt, prompt_ids, params, lora_request, seqs, tokenizer, grammar=None
    ):
        """The request's state; `grammar` (engine/grammar.py: Grammars.constraints_for) makes a
        grammar constraint for each completion."""
        state = cls(request_id, prompt, list(prompt_ids), params, lora_request)
        bias = None
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias, np.int64)
            bias = ids, np.fromiter(params.logit_bias.values(), np.float32)
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
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            lp = [] if want_lp else None
            constraint = grammar() if grammar is not None else None
            state.completions.append(
                Completion(i, seq, detok, gen, lp, 0.0 if want_lp else None, constraint, bias)
            )
        return state

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def add_prompt_logprobs(self, logits: np.ndarray, positions: list[int], tokenizer) -> None:
        """Logprobs of the prompt tokens after `positions` from their logits rows [k, V]."""
        nxt = [self.prompt_token_ids[p + 1] for p in positions]
        lps = prompt_logprobs(logits, nxt, self.params.prompt_logprobs)
        self.prompt_logprobs.extend(decorated(lp, tokenizer) for lp in lps)

    def output(self) -> RequestOutput:
        outputs = [c.output() for c in self.completions]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=outputs,
            finished=all(o.finish_reason is not None for o in outputs),
            lora_request=self.lora_request,
            num_cached_tokens=self.completions[0].seq.num_cached_tokens,
        )


class Owner(NamedTuple):
    """Whose a completion id is: its request and its completion."""

    request: RequestState
    completion: Completion


class RequestTracker:
    """The unfinished requests, their completions by completion id, and the finish path."""

    def __init__(self, scheduler: Scheduler, registry: AdapterRegistry):
        self.scheduler = scheduler
        self.registry = registry
        self.requests: dict[str, RequestState] = {}
        self._owners: dict[str, Owner] = {}  # by completion id
        self._failures: list[tuple[str, Exception]] = []

    def __bool__(self) -> bool:
        return bool(self.requests)

    def add(self, state: RequestState) -> None:
        """Queue every completion of a checked request with the scheduler."""
        if state.request_id in self.requests:
            raise RequestError(f"request id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        for c in state.completions:
            self._owners[c.seq.completion_id] = Owner(state, c)
            for aid in c.seq.adapter_ids:
                self.registry.add_user(aid)
            self.scheduler.add(c.seq)
        for aid in state.completions[0].seq.adapter_ids:  # n >= 1 completions
            self.registry.count_request(aid)

    def owner(self, completion_id: str) -> Owner:
        return self._owners[completion_id]

    def find(self, completion_id: str) -> Owner | None:
        """owner(), or None once the completion has finished (or its request failed)."""
        return self._owners.get(completion_id)

    def unfinished(self) -> list[Seq]:
        """Every unfinished sequence, waiting or running."""
        return [c.seq for _, c in self._owners.values()]

    def finish(self, seqs: Iterable[Seq]) -> None:
        """Sequences the scheduler has ended (status FINISHED_*): finish their completions
        (a request whose completions are all finished is retired)."""
        for seq in seqs:
            self._finish(seq)

    def abort(self, request_id: str, error: Exception | None = None) -> RequestOutput | None:
        """End a request now (client gone, or `error`, reported by take_failures); its pages
        are free at once. Returns its final output, None if it is unknown or done."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for c in state.completions:
            seq = self.scheduler.abort(c.seq.completion_id)
            if seq is None and c.seq.completion_id in self._owners and c.seq.is_finished:
                seq = c.seq  # ended by the scheduler in a step that failed before finish()
            if seq is not None:
                self._finish(seq)
        if error is not None:
            self._failures.append((request_id, error))
        return state.output()

    def fail_all(self, completion_ids: Iterable[str], exc: Exception, context: str) -> None:
        """End the requests of these completions with `exc`: a RequestError or AdapterError
        as it is; anything else is an internal error, logged once with its traceback under
        an error id, and the requests get only the id (errors.internal_error)."""
        if not isinstance(exc, (RequestError, AdapterError)):
            exc = internal_error(exc, context)
        for cid in completion_ids:
            owner = self._owners.get(cid)
            if owner is not None:
                self.abort(owner.request.request_id, exc)

    def fail_adapter(self, adapter_id: int, error: Exception) -> None:
        """End every request that runs with an adapter whose weights could not be loaded
        (alone or composed), with `error`; its pages (resident without its weights) go."""
        for state in list(self.requests.values()):
            if any(adapter_id in c.seq.adapter_ids for c in state.completions):
                self.abort(state.request_id, error)
        self.drop_adapter(adapter_id)

    def drop_adapter(self, adapter_id: int) -> None:
        """Free an unloaded (or unloadable) adapter's pool pages and the KV blocks cached
        under it: the one place an adapter leaves the pool but for eviction."""
        self.scheduler.pool.drop_adapter(adapter_id)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests ended by an error since the last call: an
        adapter that failed to load, a fault in their input or output, a failed step."""
        out, self._failures = self._failures, []
        return out

    def _finish(self, seq: Seq) -> None:
        assert seq.is_finished, f"{seq} has not finished"
        state, c = self._owners.pop(seq.completion_id)
        if c.detok.stopped is None:
            c.detok.finish()  # release the text held back for stop strings and UTF-8
        for aid in seq.adapter_ids:
            drained = self.registry.remove_user(aid)
            if drained is not None:
                self.drop_adapter(drained)
        if state.finished:  # (every status may have been set by the same on_step_done)
            self.requests.pop(state.request_id, None)
