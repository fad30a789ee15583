"""The event loop never waits on a request's work: while the requests that once froze every
route for 4-60 s are sent (hostile_bodies.py), /health keeps answering.

The target is a /health p99 under 100 ms; on a shared CI machine the test asserts the worst
poll under 2 s (before the fix: 4-60 s; seen here: 0.1-0.2 s idle, up to 0.5 s with the CPUs
busy elsewhere) and prints the p50/p99/max it saw.
`python tests/reliability/health_load.py` measures the same under a longer mixed load, with
the server in its own process, and saves the figures (docs/reliability/health_load.json).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from hostile_bodies import HealthPoller, hostile_bodies
from reliability_server import TIMEOUT_S

MAX_HEALTH_S = 2.0


def send(url: str, path: str, body: bytes) -> int:
    headers = {"Content-Type": "application/json"}
    try:
        r = httpx.post(url + path, content=body, headers=headers, timeout=TIMEOUT_S)
    except httpx.WriteError:  # the server answered 413 and closed before the body was sent
        return 413
    return r.status_code


def test_health_answers_while_hostile_requests_are_served(served):
    bodies = hostile_bodies()  # built before polling: the server shares this process
    with HealthPoller(served.url) as poller, ThreadPoolExecutor(4) as pool:
        sent = [
            (name, expected, pool.submit(send, served.url, path, body))
            for name, path, body, expected in bodies * 3  # each three times, 4 at a time
        ]
        statuses = [(name, expected, future.result()) for name, expected, future in sent]
    summary = poller.summary()
    print(f"/health while hostile requests were served: {summary}")
    for name, expected, status in statuses:
        assert status in expected, (name, status)
    assert summary["failures"] == 0, summary
    assert summary["polls"] >= 20, summary
    assert summary["max_ms"] < 1000 * MAX_HEALTH_S, summary
    served.assert_serving()
