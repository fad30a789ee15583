"""Hostile and careless requests against the real engine: each is answered with a 4xx that
names the problem (or served, where it is valid after all), and afterwards the server is
healthy and its fixed greedy output unchanged. Includes every request that once killed the
engine (top_k past int64, a negative seed, lone surrogates, a NUL in a path, template
kwargs that collide, top_k over the vocabulary in a batch)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from reliability_server import GREEDY, TIMEOUT_S

CMPL, CHAT, LOAD = "/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"
MSGS = [{"role": "user", "content": "hi"}]


def cmpl(**fields) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"messages": MSGS, "max_tokens": 4, **fields}


# (path, JSON body or raw bytes, status, text the error message must hold)
CASES = {
    "top_k past int64": (CMPL, cmpl(top_k=10**20), 400, "top_k"),
    "top_k 1e20 float": (CMPL, b'{"prompt": [5], "max_tokens": 2, "top_k": 1e20}', 400, "top_k"),
    "negative seed": (CMPL, cmpl(seed=-1), 400, "seed"),
    "seed past 2^64": (CMPL, cmpl(seed=2**64), 400, "seed"),
    "largest seed": (CMPL, cmpl(seed=2**64 - 1, temperature=1.0), 200, ""),
    "NaN temperature": (CMPL, b'{"prompt": [5], "temperature": NaN}', 400, "temperature"),
    "inf penalty": (CMPL, b'{"prompt": [5], "repetition_penalty": Infinity}', 400, "repetition"),
    "huge penalty": (CMPL, cmpl(repetition_penalty=1e308, temperature=0), 200, ""),
    "max_tokens -1": (CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
    "chat max_tokens 0": (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    "logit_bias past the vocabulary": (CMPL, cmpl(logit_bias={"99999999": 5}), 400, "vocabulary"),
    "invalid JSON schema": (CHAT, chat(guided_json={"type": "nope"}), 400, "guided_json"),
    "regex the engine rejects": (CMPL, cmpl(guided_regex="(?<=a)b"), 400, "guided_regex"),
    "max_tokens 2^63": (CMPL, cmpl(max_tokens=2**63), 400, "max_tokens"),
    "max_tokens over context": (CMPL, cmpl(max_tokens=10**6), 400, "maximum context length"),
    "n 17": (CMPL, cmpl(n=17), 400, "n"),
    "logprobs 21": (CMPL, cmpl(logprobs=21), 400, "logprobs"),
    "17 stop strings": (CMPL, cmpl(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    "token id past the vocabulary": (CMPL, cmpl(prompt=[5, 10**30]), 400, "prompt"),
    "empty prompt": (CMPL, cmpl(prompt=""), 400, "prompt"),
    "lone surrogate prompt": (CMPL, b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    "lone surrogate in chat": (
        CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogate",
    ),
    "lone surrogate in a key": (CHAT, b'{"messages": [], "\\ud800": 1}', 400, "surrogate"),
    "request chat template": (CHAT, chat(chat_template="{{ 1/0 }}"), 400, "chat_template"),
    "kwargs messages": (CHAT, chat(chat_template_kwargs={"messages": []}), 400, "messages"),
    "kwargs template": (CHAT, chat(chat_template_kwargs={"template": "x"}), 400, "template"),
    "kwargs self": (CHAT, chat(chat_template_kwargs={"self": 1}), 400, "self"),
    "kwargs add_generation_prompt": (
        CHAT, chat(chat_template_kwargs={"add_generation_prompt": 0}), 400, "add_generation",
    ),
    "NUL in lora_path": (LOAD, {"lora_name": "x", "lora_path": "qv\u0000"}, 400, "NUL"),
    "base model's name": (LOAD, {"lora_name": "@BASE@", "lora_path": "qv"}, 400, "base model"),
    "name of 100k chars": (LOAD, {"lora_name": "a" * 100_000, "lora_path": "qv"}, 400, "lora"),
    "name with a newline": (LOAD, {"lora_name": "a\nb", "lora_path": "qv"}, 400, "not allowed"),
    "name with a quote": (LOAD, {"lora_name": 'a"b', "lora_path": "qv"}, 400, "not allowed"),
    "name with a plus": (LOAD, {"lora_name": "qv+mlp", "lora_path": "qv"}, 400, "not allowed"),
    "name already served": (LOAD, {"lora_name": "qv", "lora_path": "mlp"}, 400, "already"),
    "traversal": (LOAD, {"lora_name": "x", "lora_path": "../../etc"}, 403, "outside"),
    "absolute path out": (LOAD, {"lora_name": "x", "lora_path": "/etc"}, 403, "outside"),
    "path far too long": (LOAD, {"lora_name": "x", "lora_path": "a/" * 2000}, 400, "lora_path"),
    "prompts past the queue": (CMPL, cmpl(prompt=[[5]] * 1025), 400, "max-queued-requests"),
    "not JSON": (CMPL, b"{not json", 400, ""),
    "a JSON array": (CMPL, b"[1, 2, 3]", 400, ""),
    "deeply nested": (CMPL, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ""),
    "unknown model": (CMPL, cmpl(model="nope"), 404, "nope"),
    "unknown /v1 path": ("/v1/nothing", {}, 404, "/v1/nothing"),
    "unload unknown": ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "nope"),
}  # fmt: skip


def send(served, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return httpx.post(served.url + path, content=body, headers=headers, timeout=TIMEOUT_S)
    text = json.dumps(body).replace("@BASE@", served.base)
    return httpx.post(
        served.url + path,
        content=text.encode(),
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_request(served, case):
    path, body, status, needle = CASES[case]
    r = send(served, path, body)
    assert r.status_code == status, r.text
    if status >= 400:
        error = r.json()["error"]
        assert needle in error["message"] or needle == error["param"], error
        assert "Traceback" not in r.text and "Error:" not in error["message"][:40], error
    served.assert_serving()


def test_top_k_over_the_vocabulary_in_a_batch(served):
    """Two sampled requests in one step, one with top_k far past the vocabulary: both are
    served (the batch used to fail, killing the engine)."""
    bodies = [cmpl(top_k=10**6, temperature=1.0, seed=1), cmpl(top_k=5, temperature=1.0, seed=2)]
    results = [None, None]

    def run(i):
        results[i] = send(served, CMPL, {**bodies[i], "max_tokens": 16})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    served.assert_serving()


def test_prompt_list_past_the_queue_is_refused_before_any_work(served):
    """1025 prompts: 400 at once, nothing queued (no engine request was ever added)."""
    r = send(served, CMPL, cmpl(prompt=[[5]] * 1025, max_tokens=64))
    assert r.status_code == 400
    assert not served.engine.engine.has_unfinished_requests()


def test_cheap_routes_answer_during_a_long_step(served, monkeypatch):
    """/health, /v1/models, /metrics and a 404 are answered while a step holds the engine (a
    stalled model run, released by the test), never waiting for it."""
    session = served.engine.engine.runner.session
    run, entered, release = session.run, threading.Event(), threading.Event()

    def stalled(inputs, **kw):
        entered.set()
        release.wait(TIMEOUT_S)
        return run(inputs, **kw)

    monkeypatch.setattr(session, "run", stalled)
    worker = threading.Thread(target=send, args=(served, CMPL, {**cmpl(), **GREEDY}))
    worker.start()
    try:
        assert entered.wait(TIMEOUT_S)
        for path, status in [("/health", 200), ("/v1/models", 200), ("/metrics", 200)]:
            assert httpx.get(served.url + path, timeout=5).status_code == status, path
        r = send(served, CMPL, cmpl(model="nope"))
        assert r.status_code == 404
    finally:
        release.set()
        worker.join(TIMEOUT_S)
    monkeypatch.undo()
    served.assert_serving()


def test_unload_is_final(served):
    """Requests racing an unload either finish on the adapter or get 404; once the unload
    returned, the adapter is not listed and nothing registers it again."""
    for round_ in range(10):
        r = served.post(LOAD, {"lora_name": "race", "lora_path": "qv"})
        assert r.status_code == 200, r.text
        body = {**cmpl(max_tokens=8), "model": "race"}
        results = []
        workers = [
            threading.Thread(target=lambda: results.append(send(served, CMPL, body)))
            for _ in range(6)
        ]
        for w in workers:
            w.start()
        unload = served.post("/v1/unload_lora_adapter", {"lora_name": "race"})
        for w in workers:
            w.join(TIMEOUT_S)
        assert unload.status_code == 200, unload.text
        assert {r.status_code for r in results} <= {200, 404}, [r.text for r in results]
        listed = httpx.get(served.url + "/v1/models", timeout=TIMEOUT_S).json()["data"]
        assert "race" not in {m["id"] for m in listed}, round_
        assert send(served, CMPL, body).status_code == 404
    served.assert_serving()


def test_large_prompts_do_not_stall_the_event_loop(served):
    """Four 1 MB prompts are tokenized off the event loop: /health answers meanwhile (and
    the prompts, past the context, get 400)."""
    big = cmpl(prompt="word " * 200_000)
    results = []
    workers = [
        threading.Thread(target=lambda: results.append(send(served, CMPL, big))) for _ in range(4)
    ]
    for w in workers:
        w.start()
    for _ in range(5):
        assert httpx.get(served.url + "/health", timeout=5).status_code == 200
    for w in workers:
        w.join(TIMEOUT_S)
    assert [r.status_code for r in results] == [400] * 4
    served.assert_serving()
