"""Completions and chat completions: request -> engine.generate -> JSON or an SSE stream.

The engine runs on its own thread; everything here is async and only awaits the engine's
iterators. A client that goes away cancels the iteration, which aborts the request in the
engine (its pages are freed within one step); `engine.abort` is called as well, to be sure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.server.adapter_templates import AdapterTemplates
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.errors import APIError, api_error, bad_request, model_not_found
from ort_lora.server.formats import ChatFormat, CompletionFormat
from ort_lora.server.limits import PromptBound
from ort_lora.server.metrics import RequestTimer, ServerMetrics
from ort_lora.server.protocol import UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from ort_lora.server.structured import OutputSpec, output_spec
from ort_lora.server.tool_prompt import TemplateTools, ToolPrompting
from ort_lora.tokenizer import ChatTemplateError

DISCONNECT_POLL_S = 0.25
Lora = LoRARequest | list[LoRARequest] | None  # a list: adapters composed, with their weights
logger = logging.getLogger("ort_lora.server")


@dataclass
class _Job:
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


@dataclass
class ChatRun:
    """A started chat generation: what chat completions and the Responses API format."""

    job: _Job
    spec: OutputSpec
    model: str
    request_id: str


class OpenAIServing:
    """Serves /v1/completions and /v1/chat/completions against one engine (and, through
    start_chat, the Responses API: openai_responses.py)."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        base_name: str,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
        allow_unknown_fields: bool = False,
        prompt_bound: PromptBound | None = None,
    ):
        self.engine = engine
        self.prompt_bound = prompt_bound or PromptBound.for_engine(engine)
        self.metrics = metrics
        self.base_name = base_name
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser  # None: the one the chat template implies
        self.tool_prompting = ToolPrompting(engine.tokenizer)
        self.allow_unknown_fields = allow_unknown_fields
        self.adapter_templates = AdapterTemplates()  # adapters' own; app.py sets its root

    # -- model and prompt resolution ------------------------------------------------------------

    async def resolve_model(self, name: str | None) -> Lora:
        """The adapter a request's `model` names; None for the base model; for "a+b" the
        adapters composed, weight 1 each (400 if one is not served); else 404."""
        if name is None or name == self.base_name:
            return None
        for lora in self.engine.list_loras():  # a snapshot: never waits for a step
            if lora.lora_name == name:
                return lora
        if "+" not in name:  # adapter names never hold "+" (registry.NAME_RE)
            raise model_not_found(name)
        return self._composed([(part, 1.0) for part in name.split("+")], "model")

    async def resolve_adapters(self, req) -> Lora:
        """What a completion runs with: its `adapters` (a composition: `model` omitted, the
        base model's name or the names joined by "+"), else what its `model` names."""
        if req.adapters is None:
            return await self.resolve_model(req.model)
        names = [a.name for a in req.adapters]
        if not names:
            raise bad_request("adapters: a composition names no adapter: expected one or more",
                              "adapters")  # fmt: skip
        if req.model not in (None, self.base_name, "+".join(names)):
            raise bad_request(
                f"model {req.model!r} disagrees with adapters {names}: with adapters, model is "
                f"omitted, the base model's name or {'+'.join(names)!r}",
                "model",
            )
        return self._composed([(a.name, a.weight) for a in req.adapters], "adapters")

    def _composed(self, terms: list[tuple[str, float]], param: str) -> list[LoRARequest]:
        """The served adapters of a composition's (name, weight) terms; 400 naming an empty
        or unknown name. The engine checks the rest (count, repeats, DoRA)."""
        served = {lora.lora_name: lora for lora in self.engine.list_loras()}
        out = []
        for name, weight in terms:
            if name not in served:
                what = f"adapter {name!r}" if name else "an empty adapter name"
                raise APIError(
                    400,
                    f"{param}: {what} in the composition is not served (adapters: "
                    f"{sorted(served)[:20]})",
                    param=param,
                    code="model_not_found",
                )
            try:
                out.append(replace(served[name], weight=weight))
            except ValueError as exc:  # LoRARequest's own check of the weight
                raise bad_request(f"{param}: {exc}", param) from exc
        return out

    def model_label(self, req, lora: Lora) -> str:
        """The `model` a response and its metrics name: a composition's adapter names joined
        by "+", else the request's model (or the base model's name)."""
        if isinstance(lora, list):
            return "+".join(r.lora_name for r in lora)
        return req.model or self.base_name

    def chat_template_for(self, lora: Lora) -> str | None:
        """An adapter's own chat template wins over the model's; a composition's adapters'
        when they all carry the same one. Read under adapter_templates.py's rules (inside the
        adapter root, regular, size-capped), cached per adapter."""
        if isinstance(lora, list):
            templates = {self.chat_template_for(r) for r in lora}
            return templates.pop() if len(templates) == 1 else None
        return None if lora is None else self.adapter_templates.get(lora)

    # -- engine calls ---------------------------------------------------------------------------

    async def _open(self, index, prompt_ids, params, lora, request_id, model) -> _Job:
        """Start one generation and wait for its first output (errors surface here)."""
        agen = self.engine.generate(prompt_ids, params, lora_request=lora, request_id=request_id)
        timer = RequestTimer(self.metrics, model, time.monotonic())
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            raise api_error(exc, request_id) from exc
        return _Job(index, request_id, prompt_ids, first, agen, timer)

    async def _open_all(
        self, raw, prompts, params, lora, request_id, model, lora_param: str = "model",
        prompt_param: str = "prompt",
    ) -> list[_Job]:  # fmt: skip
        opens = [
            self._open(i, ids, p, lora, f"{request_id}-{i}", model)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        results = await _abort_on_disconnect(
            raw, asyncio.gather(*opens, return_exceptions=True), self._aborter(request_id, prompts)
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for job in results:
                if not isinstance(job, BaseException):
                    await _close(self.engine, job)
            error = errors[0]
            if isinstance(error, APIError) and error.code == "invalid_composition":
                error.param = lora_param  # the field the composition came from
            if isinstance(error, APIError) and error.param == "prompt":
                error.param = prompt_param  # the field the prompt came from (chat: messages)
            raise error
        return results

    def _aborter(self, request_id: str, prompts: list):
        def abort():
            for i in range(len(prompts)):
                with contextlib.suppress(Exception):
                    self.engine.abort(f"{request_id}-{i}")

        return abort

    async def iterate(self, job: _Job) -> AsyncIterator[tuple[_Job, RequestOutput]]:
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
            await _close(self.engine, job, last)

    def iterate_all(self, jobs: list[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        return merge([self.iterate(job) for job in jobs])

    async def _collect(self, job: _Job) -> RequestOutput:
        last = None
        async for _, out in self.iterate(job):
            last = out
        return last

    # -- /v1/completions ------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request):
        """`req` passed check_fields already (bodies.py, on a worker thread)."""
        lora = await self.resolve_adapters(req)
        self._check_count(len(req.prompts()))
        self._check_sizes(req.prompts())
        spec = output_spec(req)
        prompts = await run_in_threadpool(self._encode_all, req.prompts())
        # max_tokens 0 (an echo of the prompt alone): one token is made and not shown
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        params = [_sampling(req, max_tokens, spec) for _ in prompts]
        model = self.model_label(req, lora)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        where = "adapters" if req.adapters is not None else "model"
        jobs = await self._open_all(raw, prompts, params, lora, request_id, model, where)
        texts = [p if isinstance(p, str) else None for p in req.prompts()]
        tok = self.engine.tokenizer
        shown = [(t if t is not None else tok.decode(ids), ids) for t, ids in zip(texts, prompts)]
        fmt = CompletionFormat(self, req, request_id, model, shown)
        if req.stream:
            return _sse_response(fmt.stream(jobs))
        finals = await _abort_on_disconnect(
            raw, asyncio.gather(*(self._collect(j) for j in jobs)), self._aborter(request_id, jobs)
        )
        return JSONResponse(fmt.full(jobs, finals))

    def check_fields(self, req) -> None:
        """400 naming a field the API defines that this server does not implement, or (unless
        --allow-unknown-fields) a field it does not know: never silently dropped."""
        for name, defaults in UNSUPPORTED.items():
            value = (req.model_extra or {}).get(name)
            if value is not None and value not in defaults:
                raise bad_request(f"{name} is not supported by this server", name)
        unknown = sorted(set(_unknown_fields(req)) - set(UNSUPPORTED))
        if unknown and not self.allow_unknown_fields:
            raise bad_request(
                f"unknown fields {unknown}: not part of the API this server implements "
                "(start it with --allow-unknown-fields to ignore them)",
                unknown[0],
            )

    def _check_count(self, num_prompts: int) -> None:
        """A prompt list the engine's queue could never hold is refused before any work."""
        limit = self.engine.max_queued_requests
        if num_prompts > limit:
            raise bad_request(
                f"{num_prompts} prompts in one request; this server queues at most {limit} "
                "(--max-queued-requests)",
                "prompt",
            )

    def _check_sizes(self, prompts: list) -> None:
        """A prompt longer than the context could hold is refused before it is tokenized
        (limits.PromptBound)."""
        for p in prompts:
            if isinstance(p, str):
                self.prompt_bound.check_text(len(p), "prompt")
            else:
                self.prompt_bound.check_ids(len(p), "prompt")

    def _encode_all(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt (on a worker thread, the GIL released while the
        tokenizer works: a long prompt must not stall the event loop)."""
        tok = self.engine.tokenizer
        return [tok.encode_releasing_gil(p) if isinstance(p, str) else list(p) for p in prompts]

    # -- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """`req` passed check_fields already (bodies.py, on a worker thread)."""
        run = await self.start_chat(req, raw, f"chatcmpl-{uuid.uuid4().hex}")
        fmt = ChatFormat(self, req, run.request_id, run.model, run.spec)
        if req.stream:
            return _sse_response(fmt.stream([run.job]))
        return JSONResponse(fmt.full(run.job, await self.finish_chat(raw, run)))

    async def start_chat(self, req: ChatCompletionRequest, raw: Request, request_id: str):
        """Resolve the model, render the prompt, start the generation: the path chat
        completions and the Responses API (openai_responses.py) share."""
        lora = await self.resolve_adapters(req)
        spec, prompt = await run_in_threadpool(self.prepare_chat, req, lora)
        params = [_sampling(req, req.requested_max_tokens(), spec)]
        model = self.model_label(req, lora)
        where = "adapters" if req.adapters is not None else "model"
        jobs = await self._open_all(
            raw, [prompt], params, lora, request_id, model, where, "messages"
        )
        return ChatRun(jobs[0], spec, model, request_id)

    async def finish_chat(self, raw: Request, run: ChatRun) -> RequestOutput:
        """The run's final output (aborted if the client goes away first)."""
        aborter = self._aborter(run.request_id, [run.job])
        return await _abort_on_disconnect(raw, self._collect(run.job), aborter)

    def prepare_chat(self, req, lora: Lora) -> tuple[OutputSpec, list[int]]:
        """The request's output spec and prompt ids (on a worker thread: probing a new
        template's tool support renders it). The tool-call parser is --tool-call-parser's,
        else the one the template implies (tool_prompt.py). A template that ignores tools
        gets them written in for "auto" only, where the model must choose and write a call
        on its own: "required" and named calls are the grammar's, and "none" asks for
        none (the block costs context: ~150 tokens and the tools' JSON)."""
        support = self.template_tools(req, self.template_for(req, lora))
        parser = self.tool_call_parser or (support.parser if support else None)
        spec = output_spec(req, parser)
        return spec, self.render(req, lora, spec.tools, show_tools=spec.tool_mode == "auto")

    def template_tools(self, req, template: str | None) -> TemplateTools | None:
        """What `template` does with tools (tool_prompt.py) if the request has any: tools,
        earlier calls or their results; else None, and no template is probed for it."""
        used = req.tools or any(m.role == "tool" or m.tool_calls for m in req.messages)
        return self.tool_prompting.for_template(template) if used else None

    def template_for(self, req, lora: Lora) -> str | None:
        """The request's template (only with --trust-request-chat-template), else the
        adapter's, else None (the model's)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "chat_template in a request is refused: this server renders only the model's "
                "and the adapters' own templates (start it with --trust-request-chat-template "
                "to allow it)",
                "chat_template",
            )
        return req.chat_template or self.chat_template_for(lora)

    def render(self, req, lora: Lora, tools: list[dict], show_tools: bool = True) -> list[int]:
        """A chat request's prompt ids (chat completions, /tokenize): its messages and tools
        rendered by the request's template (only with --trust-request-chat-template), else
        the adapter's or the model's (bounded in time and size, chat_template.py), then
        encoded. A template that ignores tools gets them (with `show_tools`), the earlier
        calls and their results written into the messages (tool_prompt.py). Runs on a
        worker thread; messages longer in all than the context could hold are refused first
        (limits.PromptBound)."""
        self.prompt_bound.check_text(sum(map(_message_chars, req.messages)), "messages")
        template = self.template_for(req, lora)
        tok = self.engine.tokenizer
        support = self.template_tools(req, template)
        messages = [m.as_template_dict() for m in req.messages]
        if support is not None:
            messages = support.messages(messages, tools, show_tools)
        kwargs = (req.chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
        try:
            text = tok.apply_chat_template(messages, req.add_generation_prompt, template, **kwargs)
        except ChatTemplateError as exc:
            param = "chat_template" if req.chat_template is not None else "messages"
            raise bad_request(str(exc), param) from exc
        return tok.encode_releasing_gil(text, add_special_tokens=False)

    def tokenize(self, body, lora: Lora) -> list[int]:
        """/tokenize's ids: the prompt, or the messages as a chat request would render them."""
        if body.prompt is not None:
            self.prompt_bound.check_text(len(body.prompt), "prompt")
            return self.engine.tokenizer.encode_releasing_gil(body.prompt, body.add_special_tokens)
        return self.render(body, lora, [t.model_dump(exclude_none=True) for t in body.tools or []])

    def decode_token(self, tid: int) -> str:
        return self.engine.tokenizer.token_text(tid)


def _message_chars(message) -> int:
    """The characters of a chat message the template renders: its content and its earlier
    tool calls' arguments."""
    content = message.content or ""
    chars = len(content) if isinstance(content, str) else sum(len(p.text) for p in content)
    return chars + sum(len(c.function.arguments) for c in message.tool_calls or ())


def _sampling(req, max_tokens: int | None, spec: OutputSpec):
    """The request's SamplingParams (max_tokens None: what the context leaves) with its
    output constraint; their validation errors are 400s naming the field. The engine checks
    the prompt, the lengths and the constraint itself."""
    try:
        return req.sampling_params(max_tokens, structured_outputs=spec.structured)
    except ValueError as exc:
        raise bad_request(str(exc), getattr(exc, "param", None)) from exc


def _unknown_fields(model, path: str = "") -> list[str]:
    """Dotted paths of the fields a request body has that its models do not declare."""
    out = [f"{path}{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, BaseModel):
                out += _unknown_fields(v, f"{path}{name}.")
    return out


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


async def _close(engine, job: _Job, last: RequestOutput | None = None) -> None:
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


async def _abort_on_disconnect(raw: Request, awaitable, abort):
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


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
