"""The HTTP server against a fake engine (tests/test_server_fakes.py): the OpenAI client on a
real uvicorn server; request mapping, response shapes, streaming, adapters, metrics, aborts.
The oracle for texts and prompts is transformers' tokenizer."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_fakes import FakeEngine, fake_token, smollm2_tokenizer_dir  # noqa: F401

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app
from ort_lora.tokenizer import Tokenizer

CUSTOM_TEMPLATE = "ADAPTER{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"


def make_adapter(path, template: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    if template:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


@pytest.fixture(scope="module")
def hf_tok(smollm2_tokenizer_dir):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def server(smollm2_tokenizer_dir, tmp_path_factory):  # noqa: F811
    """(url, engine, adapter_root): adapters "alpha" (own chat template) and "beta"."""
    root = tmp_path_factory.mktemp("adapters")
    engine = FakeEngine(Tokenizer.from_model_dir(smollm2_tokenizer_dir))
    engine.add_lora(LoRARequest("alpha", 1, str(make_adapter(root / "alpha", CUSTOM_TEMPLATE))))
    engine.add_lora(LoRARequest("beta", 2, str(make_adapter(root / "beta"))))
    app = create_app(engine, adapter_root=root, model_root="/models/fake")
    with ServerThread(app) as url:
        yield url, engine, root
    assert engine.started and engine.stopped


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def expected_text(hf_tok, prompt_ids, n_tokens, choice=0, lora_id=0) -> str:
    ids = [fake_token(prompt_ids, i, choice, lora_id) for i in range(n_tokens)]
    return hf_tok.decode(ids, skip_special_tokens=True)


def test_models_lists_base_and_adapters(client, server):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"fake-base", "alpha", "beta"}
    assert cards["fake-base"].parent is None and cards["fake-base"].root == "/models/fake"
    assert cards["alpha"].parent == "fake-base"
    assert cards["alpha"].root == str(server[2] / "alpha")


@pytest.mark.parametrize("model,lora_id", [("fake-base", 0), ("alpha", 1), ("beta", 2)])
def test_completion(client, hf_tok, model, lora_id):
    prompt = "Once upon a time, 日本 🎉"
    res = client.completions.create(model=model, prompt=prompt, max_tokens=7, seed=3)
    ids = hf_tok.encode(prompt)
    assert res.choices[0].text == expected_text(hf_tok, ids, 7, 0, lora_id)
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 7
    assert res.usage.total_tokens == len(ids) + 7
    assert res.model == model and res.object == "text_completion"


def test_completion_stream_matches_full(client, hf_tok):
    prompt = "Streaming test with unicode: naïve café"
    stream = client.completions.create(
        model="beta",
        prompt=prompt,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(hf_tok, hf_tok.encode(prompt), 9, 0, 2)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices


def test_continuous_usage_stats(client):
    """vLLM's stream_options extension: every chunk carries the usage so far."""
    stream = client.completions.create(
        model="beta", prompt="count", max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and len(chunks) > 1
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


def test_sampling_params_mapping(client, server):
    engine = server[1]
    client.completions.create(
        model="fake-base",
        prompt="x y z",
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        seed=11,
        stop=["zz"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    p = engine.params[-1]
    got = (p.temperature, p.top_p, p.seed, p.stop, p.presence_penalty, p.frequency_penalty)
    assert got == (0.7, 0.9, 11, ["zz"], 0.5, -0.5)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (5, 0.1, 1.2, True)
    assert p.max_tokens == 3


def test_chat_uses_template_and_max_completion_tokens(client, server, hf_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there! ¿Qué tal?"},
    ]
    res = client.chat.completions.create(model="beta", messages=messages, max_completion_tokens=5)
    prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_tok.encode(prompt, add_special_tokens=False)
    assert server[1].prompts[-1] == ids
    assert res.choices[0].message.content == expected_text(hf_tok, ids, 5, 0, 2)
    assert res.choices[0].message.role == "assistant"
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 5


def test_adapter_chat_template_wins(client, server, hf_tok):
    messages = [{"role": "user", "content": "hello"}]
    client.chat.completions.create(model="alpha", messages=messages, max_tokens=2)
    assert server[1].prompts[-1] == hf_tok.encode("ADAPTER[user:hello]", add_special_tokens=False)


def test_chat_stream_with_n(client, hf_tok, server):
    messages = [{"role": "user", "content": "Count to three"}]
    stream = client.chat.completions.create(
        model="fake-base", messages=messages, max_tokens=6, n=2, stream=True
    )
    texts, roles, finish = {0: "", 1: ""}, set(), {}
    for chunk in stream:
        for c in chunk.choices:
            roles.add(c.delta.role) if c.delta.role else None
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    ids = server[1].prompts[-1]
    assert texts == {j: expected_text(hf_tok, ids, 6, j) for j in (0, 1)}
    assert roles == {"assistant"} and finish == {0: "length", 1: "length"}


def test_completion_several_prompts(client, hf_tok):
    prompts = ["first prompt", "second, longer prompt"]
    res = client.completions.create(model="fake-base", prompt=prompts, max_tokens=4, n=2)
    by_index = {c.index: c.text for c in res.choices}
    want = {
        p * 2 + j: expected_text(hf_tok, hf_tok.encode(prompts[p]), 4, j)
        for p in range(2)
        for j in range(2)
    }
    assert by_index == want


def test_token_id_prompt_and_echo(client, hf_tok):
    ids = hf_tok.encode("token ids as the prompt")
    res = client.completions.create(model="fake-base", prompt=ids, max_tokens=3, echo=True)
    assert res.choices[0].text == hf_tok.decode(ids) + expected_text(hf_tok, ids, 3)


def test_stop_string_cuts_output(client, hf_tok):
    prompt = "stop here"
    full = expected_text(hf_tok, hf_tok.encode(prompt), 12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    res = client.completions.create(model="fake-base", prompt=prompt, max_tokens=12, stop=stop)
    assert res.choices[0].text == full[: full.index(stop)]
    assert res.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, hf_tok):
    prompt = "logprobs please"
    res = client.completions.create(model="fake-base", prompt=prompt, max_tokens=4, logprobs=3)
    lp = res.choices[0].logprobs
    ids = [fake_token(hf_tok.encode(prompt), i, 0, 0) for i in range(4)]
    assert lp.tokens == [hf_tok.decode([t]) for t in ids]
    assert lp.token_logprobs == [-0.25] * 4
    assert [len(t) for t in lp.top_logprobs] == [3] * 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_chat_logprobs(client, server, hf_tok):
    res = client.chat.completions.create(
        model="fake-base",
        messages=[{"role": "user", "content": "lp"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = res.choices[0].logprobs.content
    ids = [fake_token(server[1].prompts[-1], i, 0, 0) for i in range(3)]
    assert [c.token for c in content] == [hf_tok.decode([t]) for t in ids]
    assert [c.logprob for c in content] == [-0.25] * 3
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[-0.25, -1.25]] * 3
    assert content[0].bytes == list(content[0].token.encode())


def test_health(server):
    url, engine, _ = server
    assert httpx.get(server[0] + "/health").status_code == 200
    engine.error = RuntimeError("segfault in step")
    try:
        r = httpx.get(server[0] + "/health")
        assert r.status_code == 503 and "segfault in step" in r.json()["error"]["message"]
    finally:
        engine.error = None


def test_completion_several_prompts_streamed(client, hf_tok):
    prompts = ["one", "two two", "three three three"]
    stream = client.completions.create(model="fake-base", prompt=prompts, max_tokens=5, stream=True)
    texts, finish = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    want = {i: expected_text(hf_tok, hf_tok.encode(p), 5) for i, p in enumerate(prompts)}
    assert texts == want and finish == {0: "length", 1: "length", 2: "length"}


def _metrics(url) -> dict:
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_change_with_requests_and_adapters(server, client, tmp_path):
    url, engine, root = server
    before = _metrics(url)
    client.completions.create(model="beta", prompt="metrics", max_tokens=5)
    make_adapter(root / "gamma")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "gamma"})
    assert r.status_code == 200, r.text
    after = _metrics(url)
    gen = ("ort_lora:generation_tokens_total", (("model_name", "beta"),))
    assert after[gen] - before.get(gen, 0) == 5
    ttft = ("ort_lora:time_to_first_token_seconds_count", (("model_name", "beta"),))
    assert after[ttft] - before.get(ttft, 0) == 1
    resident = ("ort_lora:lora_resident", (("location", "device"), ("lora_name", "gamma")))
    assert resident not in before and after[resident] == 1
    pages = ("ort_lora:pool_pages", (("use", "adapter"),))
    assert after[pages] == before[pages] + 3
    assert ("ort_lora:lora_loads_total", (("lora_name", "gamma"),)) in after
    assert after[("ort_lora:num_requests_running", ())] == 0
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"})


def test_disconnect_aborts_request(server):
    url, engine, _ = server
    body = {"model": "fake-base", "prompt": "a long one", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        request_id = json.loads(first[5:])["id"]
    deadline = time.monotonic() + 5
    while not any(a.startswith(request_id) for a in engine.aborted):
        assert time.monotonic() < deadline, "request was not aborted after disconnect"
        time.sleep(0.01)
    while engine.running:
        assert time.monotonic() < deadline, "aborted request still running"
        time.sleep(0.01)


def test_runtime_load_use_unload_while_streaming(server, client, hf_tok):
    url, engine, root = server
    make_adapter(root / "delta")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": "delta"})
    assert r.status_code == 200 and "delta" in r.text
    assert "delta" in {m.id for m in client.models.list().data}
    lora_id = engine.loras["delta"].lora_int_id
    stream = client.completions.create(
        model="delta", prompt="during unload", max_tokens=40, stream=True
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "delta"})
    assert r.status_code == 200, r.text
    text += "".join(c.choices[0].text for c in chunks)
    assert text == expected_text(hf_tok, hf_tok.encode("during unload"), 40, 0, lora_id)
    with pytest.raises(openai.NotFoundError, match="delta"):
        client.completions.create(model="delta", prompt="gone", max_tokens=2)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe not UTF-8",
        b'{"chat_template": [{"name": ["unhashable"], "template": "x"}]}',
    ],
    ids=["bad-json", "not-utf8", "odd-names"],
)
def test_unreadable_adapter_template_falls_back_to_model(server, client, hf_tok, content):
    """A template file in its place that holds no usable template: the adapter loads and
    chats with the model's template (a warning in the log), never a refusal or a 500."""
    url, engine, root = server
    make_adapter(root / "odd")
    (root / "odd" / "tokenizer_config.json").write_bytes(content)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "odd", "lora_path": "odd"})
    assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "hello"}]
    client.chat.completions.create(model="odd", messages=messages, max_tokens=2)
    prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert engine.prompts[-1] == hf_tok.encode(prompt, add_special_tokens=False)
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "odd"})


HERMES_OUTPUT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]


@pytest.fixture()
def hermes_client(smollm2_tokenizer_dir):  # noqa: F811
    """A server with --tool-call-parser hermes whose fake model says HERMES_OUTPUT."""
    tok = Tokenizer.from_model_dir(smollm2_tokenizer_dir)
    engine = FakeEngine(tok)
    engine.script = tok.encode(HERMES_OUTPUT, add_special_tokens=False)
    with ServerThread(create_app(engine, tool_call_parser="hermes")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_auto_tool_calls_read_by_the_hermes_parser(hermes_client):
    """tool_choice "auto": the text before the first <tool_call> is the content, the calls
    are read out of their tags, in order; streaming sends the same content as deltas (never a
    piece of a tag) and the calls with the last delta."""
    kw = dict(model="fake-base", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
              max_tokens=200)  # fmt: skip
    choice = hermes_client.chat.completions.create(**kw).choices[0]
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    chunks = [c for c in hermes_client.chat.completions.create(stream=True, **kw) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content.strip() == "Let me check." and "<" not in content
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather"), (1, "get_time")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


FOREIGN_TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
)


def test_auto_without_a_parser_names_the_flag(server, client):
    """A template that shows tools in a format no parser here reads: "auto" is a 400 naming
    the flag (the model's, which ignores tools, gets Hermes: tests/test_agents.py)."""
    url, engine, root = server
    make_adapter(root / "foreign", FOREIGN_TOOLS_TEMPLATE)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "foreign",
                                                         "lora_path": "foreign"})  # fmt: skip
    assert r.status_code == 200, r.text
    try:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as info:
            client.chat.completions.create(
                model="foreign", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
            )
        assert info.value.body["param"] == "tool_choice"
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "foreign"})
