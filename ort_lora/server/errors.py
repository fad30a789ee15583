"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to a 4xx here (FastAPI's 422 validation errors become
400); only a bug in the server itself gives a 500, and its message still has this shape,
with an error id in place of the exception (logged under that id with its traceback).
"""

from __future__ import annotations

import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError, CompositionError
from ort_lora.errors import EngineError, EngineUnavailable, QueueFullError, internal_error

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the server answers with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def adapter_load_failed(exc: Exception) -> APIError:
    """A registered adapter whose files no longer load: only its requests fail."""
    return APIError(400, str(exc), param="model", code="adapter_load_failed")


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def api_error(exc: BaseException, context: str = "request") -> APIError:
    """The HTTP error for an error of the engine or of a request: 4xx for what the client
    can fix, 503 when the engine is full or stopped, 500 with an error id for an internal
    failure (its text and traceback go to the log under that id, never to the client)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, AdapterNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, CompositionError):  # the adapters composed, as the engine checks them
        return APIError(400, str(exc), param="model", code="invalid_composition")
    if isinstance(exc, AdapterError):  # registered, but its files no longer load
        return adapter_load_failed(exc)
    if isinstance(exc, ValueError):  # the engine's check of the request (RequestError)
        return bad_request(str(exc), getattr(exc, "param", None))
    if not isinstance(exc, EngineError):
        exc = internal_error(exc, context)
    return APIError(500, str(exc), code="internal_error")


def error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status, message, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


# The value shown in a validation error: bounded (the input may be a list of 100,000 items;
# the message is built on the event loop).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 80, 80
MAX_ERRORS_SHOWN = 10
MAX_PATH_PART = 64


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem (the first few): `field.path: what is wrong (got
    value)`. A check across fields names its field itself (a RequestError's `param`). A
    field's value is shown (bounded) unless it is an object; the body never is (a check of
    the whole body has it as its input). Path parts are cut at MAX_PATH_PART characters (a
    dict key is one)."""
    lines, first_param = [], None
    errors = exc.errors()
    for err in errors[:MAX_ERRORS_SHOWN]:
        loc = [str(part)[:MAX_PATH_PART] for part in err.get("loc", ()) if part != "body"]
        named = getattr((err.get("ctx") or {}).get("error"), "param", None)
        param = named or ".".join(loc) or None
        first_param = first_param or param
        got = ""
        shown = loc and not isinstance(err.get("input"), dict)
        if shown and "input" in err and err["type"] != "missing":
            got = f" (got {_SHOWN.repr(err['input'])})"
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{param or 'body'}: {message}{got}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more problems")
    return "; ".join(lines)[:2000] or "invalid request body", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through OpenAI's format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return api_error(exc, f"{request.method} {request.url.path}").response()
