"""The FastAPI app: OpenAI-compatible API, vLLM's adapter endpoints, /health, /metrics.

    create_app(engine, api_key=..., adapter_root=...) -> FastAPI

`engine` is an `ort_lora.engine.async_engine.AsyncEngine` (or anything with its interface).
The app's lifespan starts and stops it unless `manage_engine=False`.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError, AdapterPathError
from ort_lora.lora_request import LoRARequest
from ort_lora.server.errors import APIError, install_error_handlers, model_not_found
from ort_lora.server.metrics import ServerMetrics
from ort_lora.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from ort_lora.server.serving import OpenAIServing

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _auth_dependency(api_key: str | None):
    """Bearer-token check, constant-time; no-op without a key."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return check


def resolve_adapter_path(root: Path, lora_path: str) -> Path:
    """`lora_path` (absolute, or relative to `root`) resolved; 403 unless inside `root`."""
    root = root.resolve()
    path = Path(lora_path).expanduser()
    resolved = (path if path.is_absolute() else root / path).resolve()
    if not resolved.is_relative_to(root):
        raise APIError(
            403,
            f"adapter path {lora_path!r} resolves to {resolved}, outside the adapter root {root}",
            param="lora_path",
            code="adapter_path_forbidden",
        )
    return resolved


class AdapterAdmin:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and replies)."""

    def __init__(self, engine, root: Path):
        self.engine = engine
        self.root = Path(root)
        used = [lora.lora_int_id for lora in engine.list_loras()]
        self._ids = itertools.count(max(used, default=0) + 1)

    def load(self, body: LoadLoRAAdapterRequest) -> str:
        if any(lora.lora_name == body.lora_name for lora in self.engine.list_loras()):
            raise APIError(
                400,
                f"The lora adapter '{body.lora_name}' has already been loaded.",
                param="lora_name",
            )
        path = resolve_adapter_path(self.root, body.lora_path)
        lora = LoRARequest(body.lora_name, next(self._ids), str(path))
        try:
            self.engine.add_lora(lora)
        except AdapterPathError as exc:
            raise APIError(403, str(exc), param="lora_path") from exc
        except (AdapterError, ValueError, FileNotFoundError) as exc:
            raise APIError(400, f"adapter '{body.lora_name}': {exc}", param="lora_path") from exc
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
) -> FastAPI:
    """The HTTP app around `engine`. `adapter_root` enables runtime adapter loading (paths
    must resolve inside it); `api_key` protects every /v1 route."""
    base_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(engine, metrics, base_name)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.stop()

    app = FastAPI(title="ort-lora", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    install_error_handlers(app)
    auth = [Depends(_auth_dependency(api_key))]

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop is alive; 503 once it stopped on an internal error."""
        error = getattr(engine, "error", None)
        if error is not None:
            raise APIError(503, f"the engine stopped after an internal error: {error}")
        return Response(status_code=200)

    # Plain `def` routes run on worker threads: engine.stats() and list_loras() wait for the
    # engine's current step, which must not stall the event loop (and every stream on it).
    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    def models() -> dict:
        root = model_root or base_name
        max_len = engine.max_model_len
        cards = [_model_card(base_name, root, None, max_len, created)]
        for lora in engine.list_loras():
            cards.append(_model_card(lora.lora_name, lora.lora_path, base_name, max_len, created))
        return {"object": "list", "data": cards}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    if adapter_root is not None:
        admin = AdapterAdmin(engine, Path(adapter_root))

        # Plain `def`: adapter files are read and validated on a worker thread, off the loop.
        @app.post("/v1/load_lora_adapter", dependencies=auth)
        def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return PlainTextResponse(admin.load(body))

        @app.post("/v1/unload_lora_adapter", dependencies=auth)
        def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return PlainTextResponse(admin.unload(body))

    return app
