"""The server's routes, one router per concern (create_app in app.py includes them in order):

    ops_router      GET /health, /metrics, /version: cheap reads of the engine's snapshots,
                    never its lock, so they answer during any step
    openai_router   GET /v1/models, POST /v1/completions, /v1/chat/completions (serving.py)
    tokens_router   POST /tokenize, /detokenize, GET /tokenizer_info (vLLM's)
    unknown_router  any other /v1 path: 401 without the key, then 404 (405: a wrong method)
The Responses API's router is in openai_responses.py, the adapter endpoints' in
adapter_admin.py. Request bodies are read and validated on a worker thread (bodies.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from ort_lora import __version__
from ort_lora.server import responses as R
from ort_lora.server.bodies import every_route, json_body
from ort_lora.server.engine_client import EngineClient
from ort_lora.server.errors import APIError
from ort_lora.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from ort_lora.server.protocol import ChatCompletionRequest, CompletionRequest
from ort_lora.server.protocol_vllm import DetokenizeRequest, TokenizeRequest
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
# /metrics' page from the server's metrics registry (the Ray ingress adds the cluster's)
MetricsPage = Callable[[ServerMetrics], Awaitable[bytes]]


async def engine_page(metrics: ServerMetrics) -> bytes:
    """One engine's /metrics page."""
    return metrics.render()


def ops_router(engine: EngineClient, metrics: ServerMetrics, page: MetricsPage) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_class=Response, responses=_EMPTY_200)
    async def health() -> Response:
        """200 while the engine serves; 503 once it stopped (repeated faults)."""
        error = getattr(engine, "error", None)
        if error is not None:
            raise APIError(503, str(error), code="engine_unavailable")
        return Response(status_code=200)

    @router.get("/metrics", response_class=PlainTextResponse, responses=_TEXT_200)
    async def prometheus() -> Response:
        """Behind the API key (auth.MetricsKey) unless --allow-unauthenticated-metrics."""
        return Response(await page(metrics), media_type=PROMETHEUS_CONTENT_TYPE)

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return router


def openai_router(serving: OpenAIServing, model_root: str | None, auth: list) -> APIRouter:
    router = APIRouter(dependencies=auth)
    engine, base_name, created = serving.engine, serving.base_name, int(time.time())

    @router.get("/v1/models")
    async def models() -> dict:
        root, max_len = model_root or base_name, engine.max_model_len
        cards = [_model_card(base_name, root, None, max_len, created)]
        for lora in engine.list_loras():
            cards.append(_model_card(lora.lora_name, lora.lora_path, base_name, max_len, created))
        return {"object": "list", "data": cards}

    @router.post("/v1/completions", responses=_JSON_OR_SSE_200)
    async def completions(body: Completion, raw: Request):
        return await serving.completions(body, raw)

    @router.post("/v1/chat/completions", responses=_JSON_OR_SSE_200)
    async def chat_completions(body: Chat, raw: Request):
        return await serving.chat(body, raw)

    return router


def tokens_router(serving: OpenAIServing, auth: list) -> APIRouter:
    router = APIRouter(dependencies=auth)
    engine = serving.engine

    @router.post("/tokenize")
    async def tokenize(body: Tokenize) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""
        lora = await serving.resolve_model(body.model)
        ids = await run_in_threadpool(serving.tokenize, body, lora)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": None}  # fmt: skip

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info: the tokenizer's config, special tokens and chat template."""
        return R.tokenizer_info(engine.tokenizer)

    @router.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict:
        await serving.resolve_model(body.model)
        serving.prompt_bound.check_ids(len(body.tokens), "tokens")
        return {"prompt": await run_in_threadpool(_detokenize, engine.tokenizer, body.tokens)}

    return router


def unknown_router(auth: list) -> APIRouter:
    """Included last: what no other route matched."""
    router = APIRouter()

    @router.api_route(
        "/v1/{path:path}",
        methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
        include_in_schema=False,
    )
    async def unknown_v1_route(path: str, request: Request, _=Depends(auth[0].dependency)):
        """After the key check, as vLLM: without a key an unknown /v1 path is a 401."""
        routes = every_route(request.app.routes)
        known = [r for r in routes if getattr(r, "path", None) == f"/v1/{path}"]
        if known:
            allowed = sorted({m for r in known for m in getattr(r, "methods", ())})
            raise APIError(405, f"method {request.method} not allowed; use {allowed}")
        raise APIError(404, f"no such endpoint: {request.method} /v1/{path}")

    return router


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


def _detokenize(tokenizer, tokens: list[int]) -> str:
    vocab = tokenizer.vocab_size
    if any(t >= vocab for t in tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return tokenizer.decode(tokens)
