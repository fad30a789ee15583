"""Turns engine outputs into OpenAI bodies: one JSON response, or an SSE stream of chunks.

CompletionFormat serves /v1/completions (choice index = prompt index * n + output index),
ChatFormat /v1/chat/completions. `stream` sends only what is new at every engine step,
`finish_reason` with the last delta, then a usage chunk if asked for, then `[DONE]` (with
vLLM's stream_options.continuous_usage_stats, every chunk carries the usage so far too).
Usage counts the prompt tokens the prefix cache held as OpenAI's
`prompt_tokens_details.cached_tokens`. Chat logprobs list the tokens of the content (the
end-of-turn token that ended it, whose text is not shown, has no entry); completions logprobs
list every generated token, the stop token too, as vLLM's and OpenAI's do
(lm-evaluation-harness drops the last entry of an echo as the generated token).

Completions with echo put the prompt in front of the text (and, with logprobs, its tokens'
logprobs in front of the output's, the first null), as vLLM does; max_tokens 0 shows the
prompt alone. Chat with tools reads tool calls out of the output (server/structured.py), with
finish_reason "tool_calls": a named tool_choice streams its call as OpenAI does (id and name
first, then the arguments as they are generated); "required" and "auto" calls are sent whole
with the last delta, when they can be parsed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from ort_lora.outputs import CompletionOutput, RequestOutput
from ort_lora.server import responses as R
from ort_lora.server.errors import api_error, error_body
from ort_lora.server.structured import OutputSpec, new_call, streamable_text, tool_calls


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

    def usage(self, jobs, finals: list[RequestOutput | None]) -> dict:
        """Tokens of the prompts and of the outputs so far; the prompts' tokens the prefix
        cache held (RequestOutput.num_cached_tokens) as OpenAI's cached_tokens."""
        done = [f for f in finals if f is not None]
        generated = sum(len(self.visible(c).token_ids) for f in done for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in done)
        return R.usage(sum(len(j.prompt_ids) for j in jobs), generated, cached)

    def visible(self, c: CompletionOutput) -> CompletionOutput:
        """What the client sees of an output (CompletionFormat hides a max_tokens 0 token)."""
        return c

    def ready(self, c: CompletionOutput, out: RequestOutput) -> bool:
        """Whether a chunk may go now (an echo with logprobs waits for the prompt's)."""
        return True

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
                    c = self.visible(c)
                    index = job.index * self.req.n + c.index
                    tracker = trackers.setdefault(index, self.new_tracker(index, job.index))
                    news = tracker.is_news(c) and self.ready(c, out)
                    choice = self.chunk_choice(tracker, c, out) if news else None
                    if choice is not None:
                        chunk = self.body(self.chunk_kind, [choice])
                        if self.req.continuous_usage:
                            chunk["usage"] = self.usage(jobs, [finals.get(j.index) for j in jobs])
                        yield R.sse(chunk)
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

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput, out) -> dict | None:
        """The new part of choice `c` as a chunk choice; None if nothing to send (a token
        whose text is held back, e.g. half a UTF-8 character)."""
        raise NotImplementedError

    def decode(self, tid: int) -> str:
        return self.serving.decode_token(tid)


class CompletionFormat(_Format):
    kind = chunk_kind = "text_completion"

    def __init__(self, serving, req, request_id, model, prompts: list[tuple[str, list[int]]]):
        """prompts: per prompt, its text and token ids (what an echo shows)."""
        super().__init__(serving, req, request_id, model)
        self.echo = [text if req.echo else "" for text, _ in prompts]
        self.prompt_ids = [ids for _, ids in prompts]
        self.echo_logprobs = req.echo and req.logprobs is not None

    def visible(self, c: CompletionOutput) -> CompletionOutput:
        if self.req.max_tokens != 0:
            return c
        lps = None if c.logprobs is None else []
        # nothing was asked for, so nothing stopped it: the hidden token may be EOS or a stop
        # token, and the choice still ends by length (as vLLM's does)
        ended = "length" if c.finish_reason == "stop" else c.finish_reason
        return replace(c, text="", token_ids=[], logprobs=lps, cumulative_logprob=None,
                       finish_reason=ended, stop_reason=None)  # fmt: skip

    def ready(self, c: CompletionOutput, out: RequestOutput) -> bool:
        return not self.echo_logprobs or bool(c.token_ids) or c.finish_reason is not None

    def _logprobs(self, ids, lps, offset: int) -> dict | None:
        if self.req.logprobs is None or lps is None:
            return None
        return R.completion_logprobs(ids, lps, self.decode, offset)

    def full(self, jobs, finals: list[RequestOutput]) -> dict:
        choices = []
        for job, final in zip(jobs, finals, strict=True):
            echo = self.echo[job.index]
            for c in map(self.visible, final.outputs):
                ids, lps, offset = c.token_ids, c.logprobs, len(echo)
                if self.echo_logprobs:
                    ids = self.prompt_ids[job.index] + ids
                    lps, offset = (final.prompt_logprobs or []) + (lps or []), 0
                choice = {
                    "index": job.index * self.req.n + c.index,
                    "text": echo + c.text,
                    "logprobs": self._logprobs(ids, lps, offset),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if self.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = R.prompt_logprobs(
                        final.prompt_logprobs, self.decode
                    )
                choices.append(choice)
        return {**self.body(self.kind, choices), "usage": self.usage(jobs, finals)}

    def new_tracker(self, index: int, prompt_index: int) -> R.ChoiceTracker:
        tracker = R.ChoiceTracker(index, self.echo[prompt_index])
        if self.echo_logprobs:
            tracker.ids_prefix = list(self.prompt_ids[prompt_index])
        return tracker

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput, out) -> dict:
        offset = 0 if tracker.ids_prefix else tracker.sent_chars + len(tracker.text_prefix)
        if tracker.ids_prefix:  # the first chunk of an echo with logprobs: the prompt's too
            tracker.lps_prefix = list(out.prompt_logprobs or [])
        first = tracker.sent_tokens == 0 and tracker.sent_chars == 0
        text, ids, lps = tracker.delta(c)
        tracker.finished = c.finish_reason is not None
        logprobs = self._logprobs(ids, lps, offset)
        if not text and not tracker.finished and logprobs is None:
            return None
        choice = {
            "index": tracker.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = R.prompt_logprobs(out.prompt_logprobs, self.decode)
        return choice


class ChatFormat(_Format):
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def __init__(self, serving, req, request_id: str, model: str, spec: OutputSpec):
        super().__init__(serving, req, request_id, model)
        self.spec = spec  # tools: how to read tool calls out of the output
        # special tokens: the content shows no text of theirs (unless skip_special_tokens off)
        special = serving.engine.tokenizer.all_special_ids if req.skip_special_tokens else ()
        self.unshown = frozenset(special)

    def logprob_tokens(self, c: CompletionOutput, ids: list[int], lps: list | None):
        """`ids` and `lps` (ending where `c` ends) without the token that ended `c` when the
        content does not show it (EOS, e.g. <|im_end|>, or a special stop token id): the
        entries are the content's tokens, as OpenAI's are (vLLM lists that token too)."""
        last = c.token_ids[-1] if c.token_ids else None
        ended = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
        if ended and ids and last in self.unshown:
            return ids[:-1], None if lps is None else lps[:-1]
        return ids, lps

    def _logprobs(self, ids, lps) -> dict | None:
        if not self.req.logprobs or lps is None:
            return None
        return R.chat_logprobs(ids, lps, self.req.top_logprobs or 0, self.decode)

    def _message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish_reason."""
        content, calls = tool_calls(self.spec, c.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return message, c.finish_reason

    def full(self, job, final: RequestOutput) -> dict:
        choices = []
        for c in final.outputs:
            message, reason = self._message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(*self.logprob_tokens(c, c.token_ids, c.logprobs)),
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {**self.body(self.kind, choices), "usage": self.usage([job], [final])}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = R.prompt_logprobs(final.prompt_logprobs, self.decode)
        return body

    def opening_chunks(self) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [
            self.body(self.chunk_kind, [{"index": i, "delta": role, "finish_reason": None}])
            for i in range(self.req.n)
        ]

    def chunk_choice(self, tracker: R.ChoiceTracker, c: CompletionOutput, out) -> dict:
        named = self.spec.tool_mode == "named"
        final = c.finish_reason is not None
        shown = c if named else replace(c, text=streamable_text(self.spec, c.text, final))
        text, ids, lps = tracker.delta(shown)
        tracker.finished = final
        logprobs = self._logprobs(*self.logprob_tokens(c, ids, lps))
        delta, reason = {"content": text} if text else {}, c.finish_reason
        if named:
            delta = {"tool_calls": [self._named_call_delta(tracker, text)]} if text else {}
            reason = "tool_calls" if reason == "stop" else reason
        elif final and self.spec.tool_mode is not None:
            message, reason = self._message(c)
            if message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                ]
        if not delta and not final and logprobs is None:
            return None
        return {
            "index": tracker.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": c.stop_reason,
        }

    def _named_call_delta(self, tracker: R.ChoiceTracker, arguments: str) -> dict:
        """The named call's next piece: its id, type and name first, then arguments only."""
        if tracker.call_id is not None:
            return {"index": 0, "function": {"arguments": arguments}}
        call = new_call(self.spec.named, arguments)
        tracker.call_id = call["id"]
        return {"index": 0, **call}
