"""Turns engine outputs into OpenAI bodies: one JSON response, or an SSE stream of chunks.

CompletionFormat serves /v1/completions (choice index = prompt index * n + output index),
ChatFormat /v1/chat/completions. `stream` sends only what is new at every engine step,
`finish_reason` with the last delta, then a usage chunk if asked for, then `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ort_lora.outputs import CompletionOutput, RequestOutput
from ort_lora.server import responses as R
from ort_lora.server.errors import api_error, error_body


class _Format:
    kind = ""
    chunk_kind = ""

    def __init__(self, serving, req, request_id: str, model: str):
        self.serving = serving
        self.req = req
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def body(self, kind: str, choices: list) -> dict:
        return R.envelope(kind, self.request_id, self.created, self.model, choices)

    @staticmethod
    def usage(jobs, finals: list[RequestOutput | None]) -> dict:
        generated = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
        return R.usage(sum(len(j.prompt_ids) for j in jobs), generated)

    async def stream(self, jobs) -> AsyncIterator[str]:
        """SSE events: the chunks, usage if asked for, `[DONE]`; an error event on failure."""
        finals: dict[int, RequestOutput] = {}
        try:
            for event in self.opening_chunks():
                yield R.sse(event)
            trackers: dict[int, R.ChoiceTracker] = {}
            async for job, out in self.serving.iterate_all(jobs):
                finals[job.index] = out
                for c in out.outputs:
                    index = job.index * self.req.n + c.index
                    tracker = trackers.setdefault(index, self.new_tracker(index, job.index))
                    choice = self.chunk_choice(tracker, c) if tracker.is_news(c) else None
                    if choice is not None:
                        yield R.sse(self.body(self.chunk_kind, [choice]))
            if self.req.include_usage:
                usage = self.usage(jobs, [finals.get(j.index) for j in jobs])
                yield R.sse({**self.body(self.chunk_kind, []), "usage": usage})
        except Exception as exc:  # headers are sent: report in-band, as vLLM does
            err = api_error(exc, f"stream {self.request_id}")
            yield R.sse(error_body(err.status, err.message, err.param, err.code))
        yield R.sse("[DONE]")

    def opening_chunks(self) -> list[dict]:
        return []

    def new_tracker(self, index: int, prompt_index: int) -> R.ChoiceTracker:
        return R.ChoiceTracker(index)

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput) -> dict | None:
        """The new part of choice `c` as a chunk choice; None if nothing to send (a token
        whose text is held back, e.g. half a UTF-8 character)."""
        raise NotImplementedError

    def decode(self, tid: int) -> str:
        return self.serving.decode_token(tid)


class CompletionFormat(_Format):
    kind = chunk_kind = "text_completion"

    def __init__(self, serving, req, request_id: str, model: str, echo: list[str]):
        super().__init__(serving, req, request_id, model)
        self.echo = echo  # per prompt: the prompt text when echo=True, else ""

    def _logprobs(self, ids, lps, offset: int) -> dict | None:
        if self.req.logprobs is None or lps is None:
            return None
        return R.completion_logprobs(ids, lps, self.req.logprobs, self.decode, offset)

    def full(self, jobs, finals: list[RequestOutput]) -> dict:
        choices = []
        for job, final in zip(jobs, finals, strict=True):
            echo = self.echo[job.index]
            for c in final.outputs:
                choices.append(
                    {
                        "index": job.index * self.req.n + c.index,
                        "text": echo + c.text,
                        "logprobs": self._logprobs(c.token_ids, c.logprobs, len(echo)),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {**self.body(self.kind, choices), "usage": self.usage(jobs, finals)}

    def new_tracker(self, index: int, prompt_index: int) -> R.ChoiceTracker:
        return R.ChoiceTracker(index, self.echo[prompt_index])

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput) -> dict:
        offset = tracker.sent_chars + len(tracker.text_prefix)
        text, ids, lps = tracker.delta(c)
        tracker.finished = c.finish_reason is not None
        logprobs = self._logprobs(ids, lps, offset)
        if not text and not tracker.finished and logprobs is None:
            return None
        return {
            "index": tracker.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }


class ChatFormat(_Format):
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def _logprobs(self, ids, lps) -> dict | None:
        if not self.req.logprobs or lps is None:
            return None
        return R.chat_logprobs(ids, lps, self.req.top_logprobs or 0, self.decode)

    def full(self, job, final: RequestOutput) -> dict:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        return {**self.body(self.kind, choices), "usage": self.usage([job], [final])}

    def opening_chunks(self) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [
            self.body(self.chunk_kind, [{"index": i, "delta": role, "finish_reason": None}])
            for i in range(self.req.n)
        ]

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput) -> dict:
        text, ids, lps = tracker.delta(c)
        tracker.finished = c.finish_reason is not None
        logprobs = self._logprobs(ids, lps)
        if not text and not tracker.finished and logprobs is None:
            return None
        return {
            "index": tracker.index,
            "delta": {"content": text} if text else {},
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
