"""Run-time adapter loading (vLLM's endpoints), only with --adapter-root:

    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}: the path must resolve inside the
                                 root (403 otherwise), its files must be a valid adapter and
                                 any chat template it carries safe (400 naming the problem)
    POST /v1/unload_lora_adapter {"lora_name"}: unknown -> 404

The routes are plain `def`: adapter files are read and validated on a worker thread, off the
event loop.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError, AdapterPathError
from ort_lora.adapters.names import resolve_adapter_dir
from ort_lora.lora_request import LoRARequest
from ort_lora.server.adapter_templates import check_adapter_template_files
from ort_lora.server.bodies import json_body
from ort_lora.server.errors import APIError, model_not_found
from ort_lora.server.protocol_vllm import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

LoadAdapter = Annotated[LoadLoRAAdapterRequest, json_body(LoadLoRAAdapterRequest)]
UnloadAdapter = Annotated[UnloadLoRAAdapterRequest, json_body(UnloadLoRAAdapterRequest)]
TEXT_200 = {200: {"description": "Plain text", "content": {"text/plain": {}}}}


def resolve_adapter_path(root: Path, lora_path: str) -> Path:
    """`lora_path` (absolute, or relative to `root`) resolved; 403 unless it and its files
    lie inside `root` (adapters/names.py: resolve_adapter_dir), 400 if it cannot be
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


def adapter_router(admin: AdapterAdmin, serving, auth: list) -> APIRouter:
    """The two routes over `admin`; a chat template an unloaded adapter carried is forgotten."""
    router = APIRouter(dependencies=auth)
    text = {"response_class": PlainTextResponse, "responses": TEXT_200}

    @router.post("/v1/load_lora_adapter", **text)
    def load_lora_adapter(body: LoadAdapter):
        return PlainTextResponse(admin.load(body))

    @router.post("/v1/unload_lora_adapter", **text)
    def unload_lora_adapter(body: UnloadAdapter):
        message = admin.unload(body)
        serving.adapter_templates.forget(body.lora_name)
        return PlainTextResponse(message)

    return router
