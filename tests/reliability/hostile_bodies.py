"""The request bodies that once froze every route of the server (tokenized, rendered or
validated on the event loop), with the answer each gets now; and a /health poller that
measures how long the event loop keeps /health waiting meanwhile. Used by
test_health_under_load.py and by the load script health_load.py."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx

from ort_lora.server.limits import DEFAULT_MAX_REQUEST_BYTES

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
LIMIT = DEFAULT_MAX_REQUEST_BYTES


def _json(body: dict, compact: bool = False) -> bytes:
    return json.dumps(body, separators=(",", ":") if compact else None).encode()


def _text(chars: int, seed: int = 0) -> str:
    """Text that does not repeat (hex of random bytes): no tokenizer cache helps."""
    return random.Random(seed).randbytes(chars // 2 + 1).hex()[:chars]


def _schema(chars: int) -> dict:
    properties = {f"p{i}": {"type": "string"} for i in range(chars // 24)}
    return {"type": "object", "properties": properties}


def hostile_bodies() -> list[tuple[str, str, bytes, set[int]]]:
    """(name, path, body, the statuses it may get): each was one request that stalled the
    server for 4-60 s."""
    user = {"role": "user", "content": ""}
    return [
        ("8 MiB prompt", CMPL, _json({"prompt": _text(8 * LIMIT // 4)}), {413}),
        ("prompt just under the body limit", CMPL, _json({"prompt": _text(LIMIT - 100)}), {400}),
        (
            "a million logit_bias keys",
            CMPL,
            _json({"prompt": [5], "logit_bias": {str(i): 1 for i in range(10**6)}}),
            {413},
        ),
        ("100,000 messages", CHAT, _json({"messages": [{**user, "content": "x"}] * 10**5}), {400}),
        ("4,000 empty messages", CHAT, _json({"messages": [user] * 4000}), {400}),
        (
            "4,000 messages of text",
            CHAT,
            _json({"messages": [{**user, "content": "hi"}] * 4000}),
            {400},
        ),
        ("4 MiB JSON schema", CMPL, _json({"prompt": [5], "guided_json": _schema(LIMIT)}), {413}),
        ("3 MiB JSON schema", CMPL, _json({"prompt": [5], "guided_json": _schema(3 << 20)}), {400}),
        (
            "2M stop_token_ids",
            CMPL,
            _json({"prompt": [5], "stop_token_ids": [1] * 2_000_000}),
            {413},
        ),
        (
            "2M stop_token_ids, compact (under the limit)",
            CMPL,
            _json({"prompt": [5], "stop_token_ids": [1] * 2_000_000}, compact=True),
            {400},
        ),
    ]


NORMAL = _json({"prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0})


class HealthPoller:
    """Polls GET /health every `period_s` on its own thread; `latencies` in seconds (a
    failed or timed-out poll counts as `timeout_s`)."""

    def __init__(self, url: str, period_s: float = 0.005, timeout_s: float = 10.0):
        self.url, self.period_s, self.timeout_s = url, period_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - start if ok else self.timeout_s)
                self.failures += not ok
                self._stop.wait(self.period_s)

    def summary(self) -> dict:
        """p50, p99 and max in milliseconds, and the number of polls."""
        ordered = sorted(self.latencies) or [0.0]

        def pct(q: float) -> float:
            return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

        return {"polls": len(self.latencies), "failures": self.failures, "p50_ms": pct(0.50),
                "p99_ms": pct(0.99), "max_ms": round(1000 * ordered[-1], 2)}  # fmt: skip
