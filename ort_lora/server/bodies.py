"""JSON request bodies, read and validated off the event loop.

    body: Annotated[CompletionRequest, json_body(CompletionRequest)]   # a route's parameter

FastAPI parses and validates a declared body on the event loop, where a large one (a list
of a million ids, 100,000 messages) stalls every route, /health included. `json_body`
instead reads the body (bounded by limits.BodyLimit) and runs the rest on a worker thread:
json.loads, the list limits on the parsed JSON (`max_length` of the model's fields: a len()
each, before any item is validated), the model's validation, and the app's field check
(`app.state.check_body`: unknown and unsupported fields). Errors are the same 400s as
FastAPI's validation errors. The cyclic garbage collector pauses meanwhile (CollectorPause).

The routes' OpenAPI request bodies are added by `document_bodies` (FastAPI sees only a
dependency).
"""

from __future__ import annotations

import gc
import json
import threading
import time

from annotated_types import MaxLen
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from ort_lora.server.errors import APIError, bad_request

REF = "#/components/schemas/{model}"
MAX_GC_PAUSE_S = 1.0


class CollectorPause:
    """Pauses Python's cyclic garbage collector while any body is parsed.

    A parsed body is a tree of up to millions of objects, none in a cycle (reference counting
    frees them); its allocations would trigger full collections that find nothing, each a
    pause of every thread, the event loop's too, growing with the body (100-300 ms for a
    4 MiB one). The collector runs again when the last parse ends, or, while parses keep
    overlapping, once it has been paused MAX_GC_PAUSE_S (then until they all end)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._resume = False  # whether it was enabled before the first parse
        self._since = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._resume, self._since = gc.isenabled(), time.monotonic()
                gc.disable()
            self._active += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active -= 1
            overdue = time.monotonic() - self._since > MAX_GC_PAUSE_S
            if self._resume and (self._active == 0 or overdue):
                gc.enable()


_PAUSE = CollectorPause()  # one collector per process, so one pause


def json_body(model: type[BaseModel]):
    """The dependency that gives a route its `model` body (see the module docstring)."""

    async def read(request: Request) -> BaseModel:
        raw = await request.body()
        check = getattr(request.app.state, "check_body", None)
        return await run_in_threadpool(parse_body, model, raw, check)

    read.body_model = model
    return Depends(read)


def parse_body(model: type[BaseModel], raw: bytes, check=None) -> BaseModel:
    """`raw` JSON as `model`: 400 for invalid JSON, a list over its limit, or a field the
    model refuses (as FastAPI's RequestValidationError); then `check(request)`."""
    with _PAUSE:
        return _parse(model, raw, check)


def _parse(model: type[BaseModel], raw: bytes, check) -> BaseModel:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise bad_request(f"the request body is not valid JSON: {exc}"[:300]) from None
    if isinstance(data, dict):
        check_list_limits(model, data)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    if check is not None:
        check(body)
    return body


def check_list_limits(model: type[BaseModel], data: dict) -> None:
    """400 naming the first top-level list, dict or string of `data` longer than its
    field's `max_length` (the same bound the model checks, found before item validation)."""
    for name, field in model.model_fields.items():
        value = data.get(field.alias or name)
        if not isinstance(value, list | dict | str):
            continue
        limit = min((m.max_length for m in field.metadata if isinstance(m, MaxLen)), default=None)
        if limit is not None and len(value) > limit:
            unit = "characters" if isinstance(value, str) else "items"
            raise APIError(
                400,
                f"{name}: {len(value)} {unit}; at most {limit} allowed",
                param=name,
                code="too_many_items",
            )


def every_route(routes):
    """Every route, those of included routers too (FastAPI may keep an included router as one
    entry holding its routes)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        yield from every_route(inner.routes) if inner is not None else (route,)


def document_bodies(app: FastAPI, schema: dict) -> None:
    """Add the request body (and its 400 and 413 answers) of every `json_body` route to the
    OpenAPI `schema`, with the models' schemas as components."""
    bodies = {}
    for route in every_route(app.routes):
        if isinstance(route, APIRoute):
            for dep in route.dependant.dependencies:
                model = getattr(dep.call, "body_model", None)
                if model is not None:
                    bodies[route.path, tuple(m.lower() for m in route.methods)] = model
    if not bodies:
        return
    pairs = [(m, "validation") for m in set(bodies.values())]
    _, defs = models_json_schema(pairs, ref_template=REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for (path, methods), model in bodies.items():
        for method in methods:
            op = schema["paths"][path][method]
            ref = {"$ref": REF.format(model=model.__name__)}
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            answers = op["responses"]
            answers.setdefault("400", {"description": "Invalid request (OpenAI error body)"})
            answers.setdefault("413", {"description": "Body over --max-request-bytes"})
