"""The request bodies that once froze every route of the server (tokenized, rendered or
validated on the event loop), with the answer each gets now; and a /health poller that
measures how long the event loop keeps /health waiting meanwhile. Used by
test_health_under_load.py and by the load script health_load.py."""

from __future__ import annotations

import json
import multiprocessing
import queue
import random
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
        (
            "100,000 messages",
            CHAT,
            _json({"messages": [{**user, "content": "x"}] * 10**5}),
            {400, 413},  # 413 when the body limit is under its 3.3 MB
        ),
        ("4,000 empty messages", CHAT, _json({"messages": [user] * 4000}), {400}),
        (
            "4,000 messages of text",
            CHAT,
            _json({"messages": [{**user, "content": "hi"}] * 4000}),
            {400},
        ),
        (
            "a JSON schema of the body limit",
            CMPL,
            _json({"prompt": [5], "guided_json": _schema(LIMIT)}),
            {413},
        ),
        (
            "a JSON schema of 3/4 the body limit",
            CMPL,
            _json({"prompt": [5], "guided_json": _schema(3 * LIMIT // 4)}),
            {400},
        ),
        (
            "2M stop_token_ids",
            CMPL,
            _json({"prompt": [5], "stop_token_ids": [1] * 2_000_000}),
            {413},
        ),
        (
            "stop_token_ids filling the body limit (compact: the most values it holds)",
            CMPL,
            _json({"prompt": [5], "stop_token_ids": [1] * ((LIMIT - 100) // 2)}, compact=True),
            {400},
        ),
    ]


NORMAL = _json({"prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0})


class HealthPoller:
    """Polls GET /health every `period_s` from a process of its own (the client's threads,
    building and sending large bodies, would otherwise delay the polls it times) while the
    `with` block runs; then `latencies` in seconds (a failed or timed-out poll counts as
    `timeout_s`) and `failures`."""

    def __init__(self, url: str, period_s: float = 0.005, timeout_s: float = 10.0):
        self.url, self.period_s, self.timeout_s = url, period_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._results = ctx.Queue(), ctx.Queue()
        args = (url, period_s, timeout_s, self._stop, self._results)
        self._process = ctx.Process(target=_poll_health, args=args, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._process.start()
        assert self._results.get(timeout=120) == "polling"  # started (a spawn takes a while)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.put(None)
        self.latencies, self.failures = self._results.get(timeout=self.timeout_s + 60)
        self._process.join(self.timeout_s + 5)

    def summary(self) -> dict:
        """p50, p99 and max in milliseconds, and the number of polls."""
        ordered = sorted(self.latencies) or [0.0]

        def pct(q: float) -> float:
            return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

        return {"polls": len(self.latencies), "failures": self.failures, "p50_ms": pct(0.50),
                "p99_ms": pct(0.99), "max_ms": round(1000 * ordered[-1], 2)}  # fmt: skip


def _poll_health(url: str, period_s: float, timeout_s: float, stop, results) -> None:
    """HealthPoller's process: poll until something arrives on `stop`, then put
    (latencies, failures) on `results`."""
    latencies, failures = [], 0
    with httpx.Client(timeout=timeout_s) as client:
        results.put("polling")
        while True:
            try:
                stop.get(timeout=period_s)
                break
            except queue.Empty:
                pass
            start = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start if ok else timeout_s)
            failures += not ok
    results.put((latencies, failures))
