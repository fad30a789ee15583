"""Completions and chat completions: request -> engine.generate -> JSON or an SSE stream.

OpenAIServing resolves the model a request names, checks its fields and sizes, and hands the
prompts to the engine (jobs.py: started, streamed and closed there, aborted when the client
goes away); chat requests are rendered into prompt ids by chat_render.py. The JSON bodies and
SSE chunks are formats.py's.
"""

from __future__ import annotations

import asyncio
import logging
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
from ort_lora.server.chat_render import ChatRenderer
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.errors import APIError, bad_request, model_not_found
from ort_lora.server.formats import ChatFormat, CompletionFormat
from ort_lora.server.jobs import EngineJobs, Job, Lora, abort_on_disconnect
from ort_lora.server.limits import PromptBound
from ort_lora.server.metrics import ServerMetrics
from ort_lora.server.protocol import ChatCompletionRequest, CompletionRequest
from ort_lora.server.protocol_fields import UNSUPPORTED
from ort_lora.server.structured import OutputSpec, output_spec

logger = logging.getLogger("ort_lora.server")


@dataclass
class ChatRun:
    """A started chat generation: what chat completions and the Responses API format."""

    job: Job
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
        self.allow_unknown_fields = allow_unknown_fields
        self.adapter_templates = AdapterTemplates()  # adapters' own; app.py sets its root
        self.jobs = EngineJobs(engine, metrics)
        self.chat_renderer = ChatRenderer(
            engine.tokenizer, self.prompt_bound, self.adapter_templates,
            trust_request_chat_template, tool_call_parser,
        )  # fmt: skip

    # -- model resolution -----------------------------------------------------------------------

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

    # -- generations (jobs.py) ------------------------------------------------------------------

    def iterate(self, job: Job) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """The job's outputs, with metrics (EngineJobs.iterate)."""
        return self.jobs.iterate(job)

    def iterate_all(self, jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """The jobs' outputs as they arrive (EngineJobs.iterate_all)."""
        return self.jobs.iterate_all(jobs)

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
        jobs = await self.jobs.open_all(raw, prompts, params, lora, request_id, model, where)
        texts = [p if isinstance(p, str) else None for p in req.prompts()]
        tok = self.engine.tokenizer
        shown = [(t if t is not None else tok.decode(ids), ids) for t, ids in zip(texts, prompts)]
        fmt = CompletionFormat(self, req, request_id, model, shown)
        if req.stream:
            return _sse_response(fmt.stream(jobs))
        collect = asyncio.gather(*(self.jobs.collect(j) for j in jobs))
        finals = await abort_on_disconnect(raw, collect, self.jobs.aborter(request_id, jobs))
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
        spec, prompt = await run_in_threadpool(self.chat_renderer.prepare_chat, req, lora)
        params = [_sampling(req, req.requested_max_tokens(), spec)]
        model = self.model_label(req, lora)
        where = "adapters" if req.adapters is not None else "model"
        jobs = await self.jobs.open_all(
            raw, [prompt], params, lora, request_id, model, where, "messages"
        )
        return ChatRun(jobs[0], spec, model, request_id)

    async def finish_chat(self, raw: Request, run: ChatRun) -> RequestOutput:
        """The run's final output (aborted if the client goes away first)."""
        aborter = self.jobs.aborter(run.request_id, [run.job])
        return await abort_on_disconnect(raw, self.jobs.collect(run.job), aborter)

    def tokenize(self, body, lora: Lora) -> list[int]:
        """/tokenize's ids: the prompt, or the messages as a chat request would render them
        (ChatRenderer.tokenize)."""
        return self.chat_renderer.tokenize(body, lora)

    def decode_token(self, tid: int) -> str:
        return self.engine.tokenizer.token_text(tid)


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


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
