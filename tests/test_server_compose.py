"""Composed requests over HTTP: `"model": "a+b"` (weight 1 each) and the `adapters` field
(`[{"name": "a", "weight": 0.7}, ...]`) on /v1/completions and /v1/chat/completions, served by
the real engine on the tiny random Llama export, against PEFT's add_weighted_adapter(cat);
concurrent composed, single-adapter and base requests each equal to the request alone; the
per-adapter metrics; and every bad composition a 400 naming the problem, the server serving on.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ort_lora.adapters import AdapterError
from ort_lora.bench.harness.servers import ServerThread
from ort_lora.export.tiny import save_random_adapters
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_compose_engine import PEFT_ADAPTERS, peft_model  # noqa: E402
from test_engine_peft import MAX_NEW, _oracle  # noqa: E402

PROMPT = [5, 17, 99, 3, 42, 8, 77, 120, 64, 33, 21]


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    return save_random_adapters(
        hf_model, tmp_path_factory.mktemp("compose_http"), PEFT_ADAPTERS, 900
    )


@pytest.fixture(scope="module")
def server(tiny_llama_export, adapter_dirs):
    """(url, engine): one, two and dora registered; max_loras 2."""
    from ort_lora.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=256, max_loras=2)
    for i, name in enumerate(PEFT_ADAPTERS, start=1):
        engine.add_lora(LoRARequest(name, i, str(adapter_dirs[name])))
    root = next(iter(adapter_dirs.values())).parent
    with ServerThread(create_app(engine, adapter_root=root)) as url:
        yield url, engine


def body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
            "prompt_logprobs": 1, "logprobs": 0} | kw  # fmt: skip


def complete(url, **kw) -> dict:
    res = httpx.post(url + "/v1/completions", json=body(**kw), timeout=120)
    assert res.status_code == 200, res.text
    return res.json()


def tokens_and_prompt_lps(choice) -> tuple[list[str], list[dict]]:
    lps = [{int(t): v["logprob"] for t, v in e.items()} for e in choice["prompt_logprobs"][1:]]
    return choice["logprobs"]["tokens"], lps


@pytest.mark.parametrize(
    "fields, terms",
    [
        ({"adapters": [{"name": "one", "weight": 0.7}, {"name": "two", "weight": 0.3}]},
         (("one", 0.7), ("two", 0.3))),
        ({"model": "one+two"}, (("one", 1.0), ("two", 1.0))),
        ({"model": "two+one", "adapters": [{"name": "two", "weight": 1.5},
                                           {"name": "one", "weight": -0.5}]},
         (("two", 1.5), ("one", -0.5))),
    ],
)  # fmt: skip
def test_a_composed_completion_matches_peft(server, hf_model, adapter_dirs, fields, terms):
    url, engine = server
    out = complete(url, **fields)
    assert out["model"] == "+".join(n for n, _ in terms)
    logp, greedy = _oracle(peft_model(hf_model, adapter_dirs, terms), PROMPT)
    _, lps = tokens_and_prompt_lps(out["choices"][0])
    worst = max(abs(lp - logp[pos, t]) for pos, e in enumerate(lps) for t, lp in e.items())
    assert worst < 1e-4, f"{terms}: prompt logprobs differ from PEFT by {worst:.2e}"
    want = engine.tokenizer.decode(greedy, skip_special_tokens=True)
    assert out["choices"][0]["text"] == want, f"{terms}: greedy text differs from PEFT"


def test_a_composed_chat_completion_runs_with_its_adapters(server):
    url, _ = server
    messages = [{"role": "user", "content": "hello there"}]
    req = {"messages": messages, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    composed = {"adapters": [{"name": "one", "weight": 0.7}, {"name": "two", "weight": 0.3}]}
    res = [httpx.post(url + "/v1/chat/completions", json=req | extra, timeout=120)
           for extra in (composed, {"model": "one"}, {})]  # fmt: skip
    assert [r.status_code for r in res] == [200, 200, 200], [r.text for r in res]
    assert res[0].json()["model"] == "one+two"
    texts = [r.json()["choices"][0]["message"]["content"] for r in res]
    assert texts[0] != texts[1] or texts[0] != texts[2], "the composition must change the output"


def test_concurrent_composed_single_and_base_requests_equal_each_alone(server):
    url, _ = server
    kinds = [
        {"adapters": [{"name": "one", "weight": 0.7}, {"name": "two", "weight": 0.3}]},
        {"model": "one"},
        {},
        {"model": "one+two"},
        {"adapters": [{"name": "one", "weight": 0.5}]},
    ]
    alone = [complete(url, **k)["choices"][0] for k in kinds]

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            posts = [client.post(url + "/v1/completions", json=body(**k)) for k in kinds * 2]
            return await asyncio.gather(*posts)

    for i, res in enumerate(asyncio.run(together())):
        assert res.status_code == 200, res.text
        tokens, lps = tokens_and_prompt_lps(res.json()["choices"][0])
        want_tokens, want_lps = tokens_and_prompt_lps(alone[i % len(kinds)])
        assert tokens == want_tokens, f"{kinds[i % len(kinds)]}: tokens differ from alone"
        for got, want in zip(lps, want_lps, strict=True):
            assert got.keys() == want.keys()
            assert max(abs(got[t] - want[t]) for t in got) < 1e-5


def _metric(url, name: str, labels: dict) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_per_adapter_metrics_count_composed_requests_for_each_adapter(server):
    url, engine = server
    name = "ort_lora:lora_requests_total"
    counts = engine.engine.registry.request_counts  # exact now (/metrics shows a snapshot)
    before = {a: counts.get(i, 0) for i, a in enumerate(PEFT_ADAPTERS, start=1)}
    complete(url, model="one+two")
    complete(url, model="two")
    want = {"one": before["one"] + 1, "two": before["two"] + 2, "dora": before["dora"]}
    deadline = time.monotonic() + 10
    while True:  # the engine's stats are a snapshot taken after each step
        now = {a: _metric(url, name, {"lora_name": a}) for a in PEFT_ADAPTERS}
        if now == want or time.monotonic() > deadline:
            break
        complete(url, max_tokens=1)  # a base request: one more step, one more snapshot
    assert now == want


def _post(url, path, payload: str | dict):
    data = payload if isinstance(payload, str) else json.dumps(payload)
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=data, headers=headers, timeout=120)


ONE, TWO, DORA = ({"name": n, "weight": 0.5} for n in PEFT_ADAPTERS)
BAD = [
    ('{"prompt": [1, 2], "adapters": [{"name": "one", "weight": NaN}]}',
     "adapters.0.weight", "finite number"),
    ('{"prompt": [1, 2], "adapters": [{"name": "one", "weight": Infinity}]}',
     "adapters.0.weight", "finite number"),
    ({"adapters": [{"name": "one", "weight": "heavy"}]}, "adapters.0.weight", "valid number"),
    ({"adapters": []}, "adapters", "a composition names no adapter"),
    ({"adapters": [ONE, TWO, DORA]}, "adapters",
     r"a composition of 3 adapters \(one, two, dora\) exceeds max_loras = 2"),
    ({"model": "one+two+dora"}, "model", "a composition of 3 adapters"),
    ({"adapters": [ONE, {"name": "nope"}]}, "adapters", "adapter 'nope' in the composition is not"),
    ({"model": "one+nope"}, "model", "adapter 'nope' in the composition is not served"),
    ({"model": "one+"}, "model", "an empty adapter name in the composition"),
    ({"adapters": [ONE, DORA]}, "adapters",
     "'dora' is a DoRA adapter: DoRA adapters cannot be composed"),
    ({"model": "one+dora"}, "model", "'dora' is a DoRA adapter"),
    ({"adapters": [ONE, ONE]}, "adapters", "'one' appears twice in one composition"),
    ({"model": "two", "adapters": [ONE]}, "model", "model 'two' disagrees with adapters"),
    ({"adapters": [{"name": "one", "scale": 2}]}, "adapters.scale", "unknown fields"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("payload, param, message", BAD)
def test_bad_compositions_are_400s_naming_the_problem(server, path, payload, param, message):
    import re

    url, _ = server
    if isinstance(payload, dict):
        payload = payload | {"max_tokens": 2}
        if path.endswith("chat/completions"):
            payload["messages"] = [{"role": "user", "content": "hi"}]
        else:
            payload["prompt"] = [1, 2, 3]
    elif path.endswith("chat/completions"):
        payload = payload.replace(
            '"prompt": [1, 2]', '"messages": [{"role": "user", "content": "hi"}]'
        )
    res = _post(url, path, payload)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    ok = _post(
        url, path.replace("chat/completions", "completions"), {"prompt": [1, 2], "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_dora_on_base_weights_it_cannot_read_is_a_400_naming_the_module(server, adapter_dirs):
    """As an export whose base projection comes from a producer the reader cannot invert (a
    quantization it cannot dequantize: tests/test_dora.py runs the real reader on one)."""
    url, engine = server
    registry = engine.engine.registry

    class Unreadable:
        def rows(self, layer, module, start, stop):
            raise AdapterError(
                f"the base weight of {module} in layer {layer} cannot be read back: it comes "
                "from DequantizeLinear, not a float initializer or MatMulNBits"
            )

    saved, registry.base_weights = registry.base_weights, Unreadable()
    try:
        path = str(adapter_dirs["dora"])
        res = _post(url, "/v1/load_lora_adapter", {"lora_name": "dora2", "lora_path": path})
    finally:
        registry.base_weights = saved
    assert res.status_code == 400, res.text
    message = res.json()["error"]["message"]
    assert "'dora2'" in message and "base weight of gate_proj in layer 0" in message, message
    assert "dora2" not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert complete(url, model="dora")["choices"][0]["text"] is not None


def test_tokenize_renders_a_composition_like_its_chat_request(server):
    url, _ = server
    req = {"model": "one+two", "messages": [{"role": "user", "content": "hi"}]}
    res = httpx.post(url + "/tokenize", json=req, timeout=60)
    assert res.status_code == 200, res.text
    assert np.asarray(res.json()["tokens"]).size > 0


@pytest.mark.parametrize("weight", [1000.0, -1000.0, 1e-38, 0.0])
def test_extreme_finite_weights_are_served_never_a_500(server, weight):
    """Weights are any number within +-MAX_WEIGHT: even the largest still gets an answer,
    and the server serves on."""
    url, _ = server
    adapters = [{"name": "one", "weight": weight}, {"name": "two", "weight": 1.0}]
    for stream in (False, True):
        req = body(adapters=adapters, max_tokens=2, stream=stream)
        res = httpx.post(url + "/v1/completions", json=req, timeout=120)
        assert res.status_code == 200, res.text
        assert "error" not in res.text and "NaN" not in res.text, res.text[:500]
    assert complete(url, model="one")["choices"][0]["text"] is not None
