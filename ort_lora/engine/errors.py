"""Errors the engine raises for requests a caller can fix (the server maps them to 4xx)."""


class QueueFullError(RuntimeError):
    """The engine holds max_queued_requests unfinished requests; retry later (HTTP 503)."""


class RequestError(ValueError):
    """A request the engine can never serve as given (e.g. prompt + max_tokens > context).

    param: the request field at fault, as the OpenAI API names it (None if no one field is).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
