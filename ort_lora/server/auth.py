"""The API key: `Authorization: Bearer KEY` on the /v1 routes, /tokenize, /detokenize and
/metrics (which lists the served adapters' names), unless the server runs without a key.

/metrics is guarded at the ASGI layer (`MetricsKey`), so that whatever route serves it is
covered (the Ray ingress replaces the app's own with the cluster's page); a Prometheus
scraper without the key needs --allow-unauthenticated-metrics.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ort_lora.server.errors import APIError

METRICS_PATH = "/metrics"


def _expected(api_key: str | None) -> bytes | None:
    return f"Bearer {api_key}".encode() if api_key else None


def _matches(given: bytes, expected: bytes | None) -> bool:
    """Constant-time; anything matches without a key."""
    return expected is None or hmac.compare_digest(given, expected)


def _refused() -> APIError:
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def auth_dependency(api_key: str | None):
    """The routes' bearer-token check (a FastAPI dependency); a no-op without a key."""
    expected = _expected(api_key)

    async def check(request: Request) -> None:
        if not _matches(request.headers.get("authorization", "").encode(), expected):
            raise _refused()

    return check


class MetricsKey:
    """ASGI middleware: 401 for GET /metrics without the key (when the server has one)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, _expected(api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/") == METRICS_PATH:
            given = dict(scope.get("headers", ())).get(b"authorization", b"")
            if not _matches(given, self.expected):
                return await _refused().response()(scope, receive, send)
        await self.app(scope, receive, send)
