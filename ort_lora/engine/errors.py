"""Errors the engine raises for requests a caller can fix (the server maps them to 4xx)."""


class QueueFullError(RuntimeError):
    """The engine holds max_queued_requests unfinished requests; retry later (HTTP 503)."""


class RequestError(ValueError):
    """A request the engine can never serve as given (e.g. prompt + max_tokens > context)."""
