"""The FastAPI app: OpenAI-compatible API, vLLM's adapter endpoints, /health, /metrics.

    create_app(engine, api_key=..., adapter_root=...) -> FastAPI

`engine` is an `ort_lora.engine.async_engine.AsyncEngine` (or anything with its interface).
The app's lifespan starts and stops it unless `manage_engine=False`.

The event loop never waits on a request's work: bodies are bounded as they stream in
(limits.BodyLimit) and parsed and validated on worker threads (bodies.py); prompts are
bounded before they are tokenized, and tokenized and rendered on worker threads (serving.py).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from ort_lora import __version__
from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError, AdapterPathError
from ort_lora.adapters.registry import resolve_adapter_dir
from ort_lora.lora_request import LoRARequest
from ort_lora.server import responses as R
from ort_lora.server.adapter_templates import check_adapter_template_files
from ort_lora.server.auth import MetricsKey, auth_dependency
from ort_lora.server.bodies import document_bodies, json_body
from ort_lora.server.errors import APIError, install_error_handlers, model_not_found
from ort_lora.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from ort_lora.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from ort_lora.server.openai_responses import add_responses_routes
from ort_lora.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from ort_lora.server.serving import OpenAIServing

# What the OpenAPI schema documents for the routes that are not plain JSON.
_EMPTY_200 = {200: {"description": "Healthy (empty body)", "content": None}}
_TEXT_200 = {200: {"description": "Plain text", "content": {"text/plain": {}}}}
_JSON_OR_SSE_200 = {
    200: {
        "description": "A JSON body, or a text/event-stream of chunks with stream=true",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}
# Request bodies, read and validated on a worker thread (bodies.py)
Completion = Annotated[CompletionRequest, json_body(CompletionRequest)]
Chat = Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)]
Tokenize = Annotated[TokenizeRequest, json_body(TokenizeRequest)]
Detokenize = Annotated[DetokenizeRequest, json_body(DetokenizeRequest)]
LoadAdapter = Annotated[LoadLoRAAdapterRequest, json_body(LoadLoRAAdapterRequest)]
UnloadAdapter = Annotated[UnloadLoRAAdapterRequest, json_body(UnloadLoRAAdapterRequest)]


def resolve_adapter_path(root: Path, lora_path: str) -> Path:
    """`lora_path` (absolute, or relative to `root`) resolved; 403 unless it and its files
    lie inside `root` (adapters/registry.py: resolve_adapter_dir), 400 if it cannot be
    resolved."""
    try:
        return resolve_adapter_dir(lora_path, root)
    except AdapterPathError as exc:
        raise APIError(403, str(exc), param="lora_path", code="adapter_path_forbidden") from exc
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path") from exc


def naming_adapter(name: str, exc: Exception) -> str:
    """`exc`'s message led by the adapter's name, once: the adapters package's messages
    already start with it (`adapter 'x': ...`), the template checks' and others' do not."""
    label, message = f"adapter {name!r}", str(exc)
    return message if message.startswith(label) else f"{label}: {message}"


class AdapterAdmin:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and replies)."""

    def __init__(self, engine, root: Path, base_name: str):
        self.engine = engine
        self.root = Path(root)
        self.base_name = base_name
        used = [lora.lora_int_id for lora in engine.list_loras()]
        self._ids = itertools.count(max(used, default=0) + 1)

    def load(self, body: LoadLoRAAdapterRequest) -> str:
        if body.lora_name == self.base_name:
            raise APIError(400, f"'{body.lora_name}' is the base model's name", param="lora_name")
        if any(lora.lora_name == body.lora_name for lora in self.engine.list_loras()):
            raise APIError(
                400,
                f"The lora adapter '{body.lora_name}' has already been loaded.",
                param="lora_name",
            )
        path = resolve_adapter_path(self.root, body.lora_path)
        lora = LoRARequest(body.lora_name, next(self._ids), str(path))
        try:
            check_adapter_template_files(path, self.root)  # a hostile template file refuses it
            self.engine.add_lora(lora)
        except AdapterPathError as exc:
            raise APIError(403, naming_adapter(body.lora_name, exc), param="lora_path") from exc
        except (AdapterError, ValueError, FileNotFoundError) as exc:
            raise APIError(400, naming_adapter(body.lora_name, exc), param="lora_path") from exc
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        if all(lora.lora_name != body.lora_name for lora in self.engine.list_loras()):
            raise model_not_found(body.lora_name)
        try:
            self.engine.remove_lora(body.lora_name)
        except (AdapterNotFoundError, KeyError) as exc:
            raise model_not_found(body.lora_name) from exc
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _model_card(name: str, root: str, parent: str | None, max_model_len: int, created: int):
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "ort-lora",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [],
    }


def create_app(
    engine,
    *,
    api_key: str | None = None,
    adapter_root: str | Path | None = None,
    served_model_name: str | None = None,
    model_root: str | None = None,
    manage_engine: bool = True,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    allow_unknown_fields: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allow_unauthenticated_metrics: bool = False,
) -> FastAPI:
    """The HTTP app around `engine`. `adapter_root` enables runtime adapter loading (paths
    must resolve inside it); `api_key` protects every /v1 route, /tokenize, /detokenize and
    /metrics (that one not with `allow_unauthenticated_metrics`); requests may bring their
    own chat template only with `trust_request_chat_template`; `tool_call_parser` reads the
    tool calls of tool_choice "auto" (server/structured.py; None: the one the chat template
    implies, server/tool_prompt.py); unknown request fields are 400s
    unless `allow_unknown_fields`; bodies over `max_request_bytes` are 413s."""
    base_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(
        engine, metrics, base_name, trust_request_chat_template, tool_call_parser,
        allow_unknown_fields,
    )  # fmt: skip
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            await engine.start()
        _freeze_startup_heap()
        try:
            yield
        finally:
            if manage_engine:
                await engine.stop()

    app = FastAPI(title="ort-lora", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    app.state.check_body = serving.check_fields  # bodies.py calls it on the worker thread
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if not allow_unauthenticated_metrics:
        app.add_middleware(MetricsKey, api_key=api_key)
    auth = [Depends(auth_dependency(api_key))]

    @app.get("/health", response_class=Response, responses=_EMPTY_200)
    async def health() -> Response:
        """200 while the engine serves; 503 once it stopped (repeated faults)."""
        error = getattr(engine, "error", None)
        if error is not None:
            raise APIError(503, str(error), code="engine_unavailable")
        return Response(status_code=200)

    # Cheap reads: the engine's snapshots, never its lock, so they answer during any step.
    @app.get("/metrics", response_class=PlainTextResponse, responses=_TEXT_200)
    async def prometheus() -> Response:
        """Behind the API key (auth.MetricsKey) unless --allow-unauthenticated-metrics."""
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        root = model_root or base_name
        max_len = engine.max_model_len
        cards = [_model_card(base_name, root, None, max_len, created)]
        for lora in engine.list_loras():
            cards.append(_model_card(lora.lora_name, lora.lora_path, base_name, max_len, created))
        return {"object": "list", "data": cards}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: Tokenize) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
        lora = await serving.resolve_model(body.model)
        ids = await run_in_threadpool(serving.tokenize, body, lora)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": None}  # fmt: skip

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info: the tokenizer's config, special tokens and chat template."""
        return R.tokenizer_info(engine.tokenizer)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: Detokenize) -> dict:
        await serving.resolve_model(body.model)
        serving.prompt_bound.check_ids(len(body.tokens), "tokens")
        return {"prompt": await run_in_threadpool(_detokenize, engine.tokenizer, body.tokens)}

    @app.post("/v1/completions", dependencies=auth, responses=_JSON_OR_SSE_200)
    async def completions(body: Completion, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", dependencies=auth, responses=_JSON_OR_SSE_200)
    async def chat_completions(body: Chat, raw: Request):
        return await serving.chat(body, raw)

    add_responses_routes(app, serving, auth)  # /v1/responses (openai_responses.py)

    if adapter_root is not None:
        admin = AdapterAdmin(engine, Path(adapter_root), base_name)
        serving.adapter_templates.root = admin.root

        # Plain `def`: adapter files are read and validated on a worker thread, off the loop.
        @app.post(
            "/v1/load_lora_adapter",
            dependencies=auth,
            response_class=PlainTextResponse,
            responses=_TEXT_200,
        )
        def load_lora_adapter(body: LoadAdapter):
            return PlainTextResponse(admin.load(body))

        @app.post(
            "/v1/unload_lora_adapter",
            dependencies=auth,
            response_class=PlainTextResponse,
            responses=_TEXT_200,
        )
        def unload_lora_adapter(body: UnloadAdapter):
            message = admin.unload(body)
            serving.adapter_templates.forget(body.lora_name)
            return PlainTextResponse(message)

    @app.api_route(
        "/v1/{path:path}",
        methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
        include_in_schema=False,
    )
    async def unknown_v1_route(path: str, request: Request, _=Depends(auth[0].dependency)):
        """After the key check, as vLLM: without a key an unknown /v1 path is a 401."""
        known = [r for r in app.routes if getattr(r, "path", None) == f"/v1/{path}"]
        if known:
            allowed = sorted({m for r in known for m in getattr(r, "methods", ())})
            raise APIError(405, f"method {request.method} not allowed; use {allowed}")
        raise APIError(404, f"no such endpoint: {request.method} /v1/{path}")

    _openapi_says_400(app)
    return app


def _freeze_startup_heap() -> None:
    """Move the objects of start-up (model, libraries) out of the collector's reach: a full
    collection stops every thread, the event loop's too, and its pause then grows with what
    requests allocate (bounded by the body limit), not with the whole heap (x3-5 shorter)."""
    gc.collect()
    gc.freeze()


def _detokenize(tokenizer, tokens: list[int]) -> str:
    vocab = tokenizer.vocab_size
    if any(t >= vocab for t in tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return tokenizer.decode(tokens)


def _openapi_says_400(app: FastAPI) -> None:
    """The schema documents 400 with OpenAI's error body where FastAPI would say 422 (the
    server maps validation errors to 400), and the request bodies FastAPI does not see
    (bodies.py reads them)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {"description": "Invalid request (OpenAI error body)"}
            document_bodies(app, schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
