"""What a replica streams back to the ingress: each step's RequestOutput as a delta, and a
request's error as an HTTP-shaped value. Pure: no Ray.

The engine's RequestOutputs are cumulative (all text and token ids so far). Sent as they are,
a request of n tokens would pickle O(n^2) data through Ray; `DeltaEncoder` sends, per
completion, only what changed since the previous output, `DeltaDecoder` rebuilds the
cumulative RequestOutput the serving layer expects. Each delta says where its text, token ids
and logprobs start, so the decoder is right even if an output ever shortened an earlier one.

Exceptions do not cross Ray well: RequestError's `param` is lost by pickling, and Ray wraps
the rest with the replica's traceback. A replica turns a request's error into `ReplicaError`
(the status, message, param and code `server/errors.api_error` gives it, an internal fault
logged on the replica under its error id) and the ingress raises it as that APIError.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ort_lora.outputs import CompletionOutput, RequestOutput
from ort_lora.server.errors import APIError, api_error


@dataclass(frozen=True)
class CompletionDelta:
    """One completion's change: text[text_start:] = text, likewise token ids and logprobs."""

    index: int
    text_start: int
    text: str
    ids_start: int
    token_ids: list[int]
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class OutputDelta:
    """One step of one request. `head` (the request's first output, completions emptied)
    carries the prompt once; later deltas have head=None."""

    completions: list[CompletionDelta]
    finished: bool
    head: RequestOutput | None = None


@dataclass(frozen=True)
class ReplicaError:
    """A request's error as the HTTP error it maps to (server/errors.py: api_error)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = field(default=None)

    @staticmethod
    def of(exc: BaseException, context: str) -> ReplicaError:
        """The error a request's exception answers with (an internal fault is logged here,
        on the replica, with its traceback; only its error id travels)."""
        err = api_error(exc, context)
        return ReplicaError(err.status, err.message, err.param, err.code, err.headers)

    def api_error(self) -> APIError:
        return APIError(
            self.status, self.message, param=self.param, code=self.code, headers=self.headers
        )


class DeltaEncoder:
    """On the replica: cumulative RequestOutputs of one request -> OutputDeltas."""

    def __init__(self):
        self._sent: dict[int, tuple[int, int]] = {}  # completion index -> (chars, tokens)

    def encode(self, out: RequestOutput) -> OutputDelta:
        head = None
        if not self._sent:
            head = replace(out, outputs=[])
        deltas = [self._completion(c) for c in out.outputs]
        return OutputDelta(deltas, out.finished, head)

    def _completion(self, c: CompletionOutput) -> CompletionDelta:
        chars, tokens = self._sent.get(c.index, (0, 0))
        chars, tokens = min(chars, len(c.text)), min(tokens, len(c.token_ids))
        self._sent[c.index] = (len(c.text), len(c.token_ids))
        lps = None if c.logprobs is None else list(c.logprobs[tokens:])
        return CompletionDelta(
            c.index,
            chars,
            c.text[chars:],
            tokens,
            list(c.token_ids[tokens:]),
            lps,
            c.cumulative_logprob,
            c.finish_reason,
            c.stop_reason,
        )


class DecodeError(RuntimeError):
    """A stream that does not start with its head (a bug, never a client's fault)."""


class DeltaDecoder:
    """On the ingress: OutputDeltas of one request -> cumulative RequestOutputs."""

    def __init__(self):
        self._head: RequestOutput | None = None
        self._completions: dict[int, CompletionOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        if delta.head is not None:
            self._head = delta.head
        if self._head is None:
            raise DecodeError("a replica's stream began without the request's first output")
        for d in delta.completions:
            self._completions[d.index] = _apply(self._completions.get(d.index), d)
        outputs = [_copy(self._completions[i]) for i in sorted(self._completions)]
        return replace(self._head, outputs=outputs, finished=delta.finished)


def _apply(c: CompletionOutput | None, d: CompletionDelta) -> CompletionOutput:
    if c is None:
        c = CompletionOutput(d.index, "", [], None, None if d.logprobs is None else [])
    c.text = c.text[: d.text_start] + d.text
    c.token_ids = c.token_ids[: d.ids_start] + d.token_ids
    if d.logprobs is not None:
        c.logprobs = (c.logprobs or [])[: d.ids_start] + d.logprobs
    c.cumulative_logprob, c.finish_reason, c.stop_reason = (
        d.cumulative_logprob,
        d.finish_reason,
        d.stop_reason,
    )
    return c


def _copy(c: CompletionOutput) -> CompletionOutput:
    """A snapshot: the serving layer may keep an output while the next one is decoded."""
    lps = None if c.logprobs is None else list(c.logprobs)
    return replace(c, token_ids=list(c.token_ids), logprobs=lps)
