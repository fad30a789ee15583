"""Generations in flight for the OpenAI routes: one per prompt (`Job`), started together
(`EngineJobs.open_all`), their outputs streamed with metrics (`EngineJobs.iterate`, `merge`),
each closed when it ends (`close_job`: aborted in the engine unless it finished).

The engine runs on its own thread; everything here is async and only awaits the engine's
iterators. A client that goes away cancels the iteration, which aborts the request in the
engine (its pages are freed within one step); `engine.abort` is called as well, to be sure
(`abort_on_disconnect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.errors import APIError, api_error
from ort_lora.server.metrics import RequestTimer, ServerMetrics

DISCONNECT_POLL_S = 0.25
Lora = LoRARequest | list[LoRARequest] | None  # a list: adapters composed, with their weights


@dataclass
class Job:
    """One prompt's generation: `first` is the engine's first output, `rest` the iterator."""

    index: int
    request_id: str
    prompt_ids: list[int]
    first: RequestOutput | None
    rest: AsyncIterator[RequestOutput]
    timer: RequestTimer

    async def stream(self) -> AsyncIterator[RequestOutput]:
        if self.first is not None:
            yield self.first
        async for out in self.rest:
            yield out


class EngineJobs:
    """Starts, streams and closes the generations of one engine, recording their metrics."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics

    async def _open(self, index, prompt_ids, params, lora, request_id, model) -> Job:
        """Start one generation and wait for its first output (errors surface here)."""
        agen = self.engine.generate(prompt_ids, params, lora_request=lora, request_id=request_id)
        timer = RequestTimer(self.metrics, model, time.monotonic())
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            raise api_error(exc, request_id) from exc
        return Job(index, request_id, prompt_ids, first, agen, timer)

    async def open_all(
        self, raw, prompts, params, lora, request_id, model, lora_param: str = "model",
        prompt_param: str = "prompt",
    ) -> list[Job]:  # fmt: skip
        """Start one generation per prompt (ids `<request_id>-<i>`); if one fails, close the
        others and raise its error on the field it came from."""
        opens = [
            self._open(i, ids, p, lora, f"{request_id}-{i}", model)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        results = await abort_on_disconnect(
            raw, asyncio.gather(*opens, return_exceptions=True), self.aborter(request_id, prompts)
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for job in results:
                if not isinstance(job, BaseException):
                    await close_job(self.engine, job)
            error = errors[0]
            if isinstance(error, APIError) and error.code == "invalid_composition":
                error.param = lora_param  # the field the composition came from
            if isinstance(error, APIError) and error.param == "prompt":
                error.param = prompt_param  # the field the prompt came from (chat: messages)
            raise error
        return results

    def aborter(self, request_id: str, prompts: list):
        """A callable that aborts every generation of the request in the engine."""

        def abort():
            for i in range(len(prompts)):
                with contextlib.suppress(Exception):
                    self.engine.abort(f"{request_id}-{i}")

        return abort

    async def iterate(self, job: Job) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """The job's outputs, with metrics; aborts the job if iteration stops early."""
        last = None
        try:
            async for out in job.stream():
                last = out
                job.timer.on_tokens(time.monotonic(), _num_tokens(out))
                yield job, out
        except Exception as exc:  # the request failed after it started (adapter, fault)
            raise api_error(exc, job.request_id) from exc
        finally:
            await close_job(self.engine, job, last)

    def iterate_all(self, jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
        return merge([self.iterate(job) for job in jobs])

    async def collect(self, job: Job) -> RequestOutput:
        """The job's final output."""
        last = None
        async for _, out in self.iterate(job):
            last = out
        return last


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Interleave several async iterators as items arrive; cancelling stops them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as exc:
            await queue.put((None, exc))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


async def close_job(engine, job: Job, last: RequestOutput | None = None) -> None:
    """Finish one job: abort it in the engine unless it finished, record its metrics."""
    finished = last is not None and last.finished
    if not finished:
        with contextlib.suppress(Exception):
            engine.abort(job.request_id)
    with contextlib.suppress(Exception):
        await job.rest.aclose()
    if finished:
        reasons = [c.finish_reason for c in last.outputs]
        job.timer.on_finish(time.monotonic(), len(job.prompt_ids), reasons)


async def abort_on_disconnect(raw: Request, awaitable, abort):
    """Await `awaitable`, but cancel it and call `abort()` if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                abort()
                raise APIError(499, "client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
