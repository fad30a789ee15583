"""Probes on a live LLMEngine for tests that watch a request while it runs."""

from __future__ import annotations

import time


def slow_and_record_aborts(engine, set_attr=setattr) -> list:
    """Each step of `engine` (an LLMEngine) takes >= 5 ms more, so a long request is still
    running while the test looks at it (the tiny model is otherwise done before a client reads
    its first chunk); returns the list of abort_request's results, filled as aborts happen (a
    request that finished before its abort gives None, an aborted one its final output).
    set_attr: monkeypatch.setattr where the engine outlives the test."""
    step, abort, aborted = engine.step, engine.abort_request, []

    def slow_step():
        time.sleep(0.005)
        return step()

    def record_abort(request_id):
        aborted.append(abort(request_id))
        return aborted[-1]

    set_attr(engine, "step", slow_step)
    set_attr(engine, "abort_request", record_abort)
    return aborted
