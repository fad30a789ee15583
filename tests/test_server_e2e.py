"""The server over the real engine on the tiny random Llama export (conftest fixtures), with
three random PEFT adapters. Oracle: transformers + PEFT greedy generation on the same weights;
the server's text must equal the oracle's tokens decoded. Talks to a real uvicorn server with
the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from step_probes import slow_and_record_aborts

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.export.tiny import save_random_adapters
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all2": dict(r=2, lora_alpha=4, target_modules="all-linear"),
}
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapter_root(hf_model, tmp_path_factory):
    """Random PEFT adapters (B of unit scale, so they change the output), plus a broken one."""
    root = tmp_path_factory.mktemp("e2e_adapters")
    save_random_adapters(hf_model, root, ADAPTERS, seed=500)
    shutil.copytree(root / "qv4", root / "late")  # loaded at runtime by the tests
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_export, adapter_root):
    """(url, engine): the tiny export with the three adapters, runtime loading enabled."""
    from ort_lora.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=256, max_loras=4)
    for i, name in enumerate(ADAPTERS, start=1):
        engine.add_lora(LoRARequest(name, i, str(adapter_root / name)))
    with ServerThread(create_app(engine, adapter_root=adapter_root)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oracle(hf_model, adapter_root):
    """oracle(prompt_ids, adapter name or None) -> greedy token ids of transformers + PEFT."""
    models, cache = {None: hf_model}, {}

    def run(prompt: list[int], name: str | None) -> list[int]:
        key = (tuple(prompt), name)
        if key not in cache:
            if name not in models:
                base = copy.deepcopy(hf_model)
                models[name] = peft.PeftModel.from_pretrained(base, adapter_root / name).eval()
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = models[name].generate(
                    ids,
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    attention_mask=torch.ones_like(ids),
                    pad_token_id=0,
                    eos_token_id=None,
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return run


def greedy(**kw) -> dict:
    return {"max_tokens": MAX_NEW, "temperature": 0.0, "extra_body": {"ignore_eos": True}, **kw}


def text_of(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def chat_prompt(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_models(client, server, adapter_root):
    base = server[1].model_name
    cards = {m.id: m for m in client.models.list().data}
    assert {base, *ADAPTERS} <= set(cards)
    assert all(cards[a].parent == base and cards[a].root == str(adapter_root / a) for a in ADAPTERS)
    assert cards[base].parent is None


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_completion_matches_peft(client, server, oracle, name):
    engine = server[1]
    prompt = [5, 17, 99, 3, 42, 8, 77, 120]
    res = client.completions.create(model=name or engine.model_name, prompt=prompt, **greedy())
    assert res.choices[0].text == text_of(engine, oracle(prompt, name))
    assert res.usage.completion_tokens == MAX_NEW and res.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_streaming_chat_matches_peft(client, server, oracle, name):
    engine = server[1]
    messages = [{"role": "user", "content": f"hello {name}"}]
    stream = client.chat.completions.create(
        model=name or engine.model_name, messages=messages, stream=True, **greedy()
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == text_of(engine, oracle(chat_prompt(engine, messages), name))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_adapters_change_the_output(server, oracle):
    prompt = [5, 17, 99, 3, 42, 8, 77, 120]
    outputs = {tuple(oracle(prompt, name)) for name in [None, *ADAPTERS]}
    assert len(outputs) == 1 + len(ADAPTERS)  # else the tests above could not tell them apart


def test_24_concurrent_mixed_streams(server, oracle):
    """24 streaming requests at once over the base model and every adapter: each equals what
    the oracle gives it alone."""
    url, engine = server
    names = [None, *ADAPTERS]
    jobs = [([3 + i, 40 + 2 * i, 7, 90 - i, 11 * (i % 5) + 1], names[i % 4]) for i in range(24)]
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt, name):
        stream = await aclient.completions.create(
            model=name or engine.model_name, prompt=prompt, stream=True, **greedy()
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all():
        return await asyncio.gather(*(one(p, n) for p, n in jobs))

    texts = asyncio.run(run_all())
    assert texts == [text_of(engine, oracle(p, n)) for p, n in jobs]


def _metrics(url, until=None, timeout_s: float = 10.0) -> dict:
    """/metrics as {(name, labels): value}; with `until`, polled until until(samples) holds
    (the engine's stats are a snapshot, refreshed between steps every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        if until is None or until(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never met the condition: {samples}"
        time.sleep(0.02)


@pytest.fixture
def slow_steps(server, monkeypatch) -> list:
    """The engine's steps slowed by >= 5 ms and its aborts recorded (step_probes)."""
    return slow_and_record_aborts(server[1].engine, monkeypatch.setattr)


def test_runtime_load_unload_while_streaming_and_metrics(server, client, slow_steps):
    url, engine = server
    free = ("ort_lora:pool_pages", (("use", "free"),))
    adapter_pages = ("ort_lora:pool_pages", (("use", "adapter"),))
    before = _metrics(url)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"})
    assert r.status_code == 200, r.text
    assert "late" in {m.id for m in client.models.list().data}
    late = (("lora_name", "late"),)
    # registering it copied it into free pool pages (preload_adapters): resident, idle
    loaded = _metrics(url, lambda m: m[adapter_pages] > before.get(adapter_pages, 0))
    assert loaded[free] < before[free]
    assert loaded[("ort_lora:lora_resident", (("location", "device"), *late))] == 1
    assert loaded[("ort_lora:lora_loads_total", late)] == 1
    prompt = [9, 8, 7, 6, 5]
    long = engine.max_model_len - len(prompt)  # long enough to still run while we look
    stream = client.completions.create(
        model="late", prompt=prompt, stream=True, **greedy(max_tokens=long)
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    # the adapter is in use: its request found it in the pool (a hit, no second load)
    during = _metrics(url, lambda m: m[("ort_lora:num_requests_running", ())] >= 1)
    assert during[("ort_lora:lora_hits_total", late)] == 1
    assert during[("ort_lora:lora_misses_total", late)] == 0
    assert during[("ort_lora:lora_loads_total", late)] == 1
    assert during[("ort_lora:lora_resident", (("location", "device"), *late))] == 1
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    assert engine.engine.has_unfinished_requests()  # the unload did not wait for the stream
    text += "".join(c.choices[0].text for c in chunks)
    # "late" is a copy of "qv4": the stream finished with the adapter it started with.
    with_qv4 = client.completions.create(model="qv4", prompt=prompt, **greedy(max_tokens=long))
    assert text == with_qv4.choices[0].text
    with pytest.raises(openai.NotFoundError, match="late"):
        client.completions.create(model="late", prompt=prompt, **greedy())
    after = _metrics(url)
    gen = ("ort_lora:generation_tokens_total", (("model_name", "late"),))
    assert after[gen] == long


def test_disconnect_frees_pages(server, slow_steps):
    url, engine = server
    body = {"model": engine.model_name, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    body |= {"ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        deadline = time.monotonic() + 10
        while engine.stats()["running"] != 1:  # stats: a snapshot, refreshed between steps
            assert time.monotonic() < deadline, f"not running: {engine.stats()}"
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while engine.stats()["running"] or engine.stats()["pool"]["kv"]:
        assert time.monotonic() < deadline, f"not aborted: {engine.stats()}"
        time.sleep(0.01)
    # aborted while it ran (the disconnect and the stream's end both abort: one finds it gone)
    assert [out.outputs[0].finish_reason for out in slow_steps if out] == ["abort"]


def check_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert all(n in error["message"] for n in needles), error
    return error


def test_real_engine_errors(server, adapter_root):
    url, engine = server
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "broken"})
    # the adapter (named once), the missing file and the rule; never the server's paths
    error = check_error(r, 400, "adapter 'b': ", "no adapter_model.safetensors")
    assert error["message"].count("adapter 'b'") == 1 and str(adapter_root) not in r.text
    assert error["param"] == "lora_path"
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    check_error(r, 403, "outside the adapter root")
    body = {"model": engine.model_name, "prompt": [1] * 10, "max_tokens": engine.max_model_len}
    check_error(httpx.post(url + "/v1/completions", json=body), 400, "maximum context length")
    body = {"model": "qv4", "prompt": "hi", "max_tokens": 2, "temperature": 9}
    check_error(httpx.post(url + "/v1/completions", json=body), 400, "temperature")


def test_adapter_whose_files_break_fails_only_its_requests(
    tiny_llama_export, adapter_root, oracle, tmp_path
):
    """A registered adapter whose safetensors file is damaged later (the host cache holds one
    adapter and none is preloaded into the pool, so its pool load rereads the file): its
    request gets a 400 naming it, requests of the base model and of other adapters are
    answered, and the server stays healthy."""
    from ort_lora.engine.async_engine import AsyncEngine

    for name in ("qv4", "mlp8"):
        shutil.copytree(adapter_root / name, tmp_path / name)
    engine = AsyncEngine.from_model_dir(
        tiny_llama_export, num_pages=256, max_loras=1, max_cpu_loras=1, preload_adapters=False
    )
    for i, name in enumerate(("qv4", "mlp8"), start=1):
        engine.add_lora(LoRARequest(name, i, str(tmp_path / name)))
    (tmp_path / "qv4" / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    prompt = [5, 17, 99, 3, 42, 8, 77]
    with ServerThread(create_app(engine)) as url:

        def complete(model):
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            body["ignore_eos"] = True
            return httpx.post(url + "/v1/completions", json=body, timeout=60)

        error = check_error(complete("qv4"), 400, "adapter 'qv4' could not be loaded")
        assert error["code"] == "adapter_load_failed"
        for model, adapter in ((engine.model_name, None), ("mlp8", "mlp8")):
            r = complete(model)
            assert r.status_code == 200, r.text
            want = text_of(engine, oracle(prompt, adapter))
            assert r.json()["choices"][0]["text"] == want, model
        assert httpx.get(url + "/health").status_code == 200
