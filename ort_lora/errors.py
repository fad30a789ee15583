"""Errors of the serving API: requests a caller can fix (the server maps them to 4xx) and
failures the engine reports for one request (5xx), each with what the server needs."""

import logging
import uuid
from collections.abc import Collection

logger = logging.getLogger("ort_lora")


class QueueFullError(RuntimeError):
    """The engine holds max_queued_requests unfinished requests; retry later (HTTP 503)."""


def check_room(held: Collection[str], request_id: str, limit: int, holder: str) -> None:
    """The one queue-full guard of an engine client (AsyncEngine, the Ray ingress): a
    QueueFullError when `holder` already holds `limit` requests, a ValueError when the id is
    one of them."""
    if len(held) >= limit:
        raise QueueFullError(
            f"{holder} already holds {len(held)} requests (max_queued_requests={limit}); "
            "retry later"
        )
    if request_id in held:
        raise ValueError(f"request id {request_id!r} is already in use")


class RequestError(ValueError):
    """A request the engine can never serve as given (e.g. prompt + max_tokens > context).

    param: the request field at fault, as the OpenAI API names it (None if no one field is).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineError(RuntimeError):
    """An internal failure that ended a request (HTTP 500). Its message carries only the
    error id: the exception itself was logged with that id and its traceback, and never
    reaches the client."""

    def __init__(self, error_id: str):
        super().__init__(f"internal error {error_id}; the server log has its details")
        self.error_id = error_id


class EngineUnavailable(RuntimeError):
    """The engine stopped serving after repeated faults in consecutive steps (HTTP 503);
    every request it held was answered with this."""


def internal_error(exc: BaseException, context: str) -> EngineError:
    """Log `exc` (with traceback) under a new error id; the EngineError a caller may see."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed: internal error %s", context, error_id, exc_info=exc)
    return EngineError(error_id)
