"""The FastAPI app: OpenAI-compatible API, vLLM's adapter endpoints, /health, /metrics.

    create_app(engine, api_key=..., adapter_root=...) -> FastAPI

`engine` is an EngineClient (server/engine_client.py): AsyncEngine, or the Ray ingress's
ReplicaClient. The app's lifespan starts and stops it unless `manage_engine=False`. The
routes are routers, one per concern (routes.py, openai_responses.py, adapter_admin.py),
included in order: the catch-all for unknown /v1 paths last.

The event loop never waits on a request's work: bodies are bounded as they stream in
(limits.BodyLimit) and parsed and validated on worker threads (bodies.py); prompts are
bounded before they are tokenized, and tokenized and rendered on worker threads (serving.py).
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

from fastapi import Depends, FastAPI

from ort_lora.server.adapter_admin import AdapterAdmin, adapter_router
from ort_lora.server.auth import MetricsKey, auth_dependency
from ort_lora.server.bodies import document_bodies
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.errors import install_error_handlers
from ort_lora.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from ort_lora.server.metrics import ServerMetrics
from ort_lora.server.openai_responses import responses_router
from ort_lora.server.routes import (
    MetricsPage,
    engine_page,
    openai_router,
    ops_router,
    tokens_router,
    unknown_router,
)
from ort_lora.server.serving import OpenAIServing


def create_app(
    engine: EngineClient,
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
    metrics_page: MetricsPage = engine_page,
) -> FastAPI:
    """The HTTP app around `engine`. `adapter_root` enables runtime adapter loading (paths
    must resolve inside it); `api_key` protects every /v1 route, /tokenize, /detokenize and
    /metrics (that one not with `allow_unauthenticated_metrics`); requests may bring their
    own chat template only with `trust_request_chat_template`; `tool_call_parser` reads the
    tool calls of tool_choice "auto" (server/structured.py; None: the one the chat template
    implies, server/tool_prompt.py); unknown request fields are 400s unless
    `allow_unknown_fields`; bodies over `max_request_bytes` are 413s; `metrics_page` renders
    /metrics from the server's metrics (the Ray ingress: the cluster's page)."""
    base_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(
        engine, metrics, base_name, trust_request_chat_template, tool_call_parser,
        allow_unknown_fields,
    )  # fmt: skip

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
    app.include_router(ops_router(engine, metrics, metrics_page))
    app.include_router(openai_router(serving, model_root, auth))
    app.include_router(responses_router(serving, auth))
    app.include_router(tokens_router(serving, auth))
    if adapter_root is not None:
        admin = AdapterAdmin(engine, Path(adapter_root), base_name)
        serving.adapter_templates.root = admin.root
        app.include_router(adapter_router(admin, serving, auth))
    app.include_router(unknown_router(auth))
    _openapi_says_400(app)
    return app


def _freeze_startup_heap() -> None:
    """Move the objects of start-up (model, libraries) out of the collector's reach: a full
    collection stops every thread, the event loop's too, and its pause then grows with what
    requests allocate (bounded by the body limit), not with the whole heap (x3-5 shorter)."""
    gc.collect()
    gc.freeze()


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
