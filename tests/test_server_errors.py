"""Every error a client can cause, over HTTP (httpx) against a fake engine: status code,
OpenAI's error body, and a message naming the problem. Never a 500."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from test_server_fakes import FakeEngine, smollm2_tokenizer_dir  # noqa: F401

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app
from ort_lora.tokenizer import Tokenizer

KEY = "sk-test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):  # noqa: F811
    return Tokenizer.from_model_dir(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    """(url, engine, adapter_root, outside_dir), with an API key and max_running=1."""
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "adapter_config.json").write_text("{}")
    (root / "good").mkdir()
    (root / "good" / "adapter_config.json").write_text("{}")
    (root / "empty").mkdir()
    os.symlink(outside, root / "sneaky")
    engine = FakeEngine(tokenizer, max_model_len=64, max_running=1)
    engine.add_lora(LoRARequest("ada", 1, str(root / "good")))
    with ServerThread(create_app(engine, api_key=KEY, adapter_root=root)) as url:
        yield url, engine, root, outside


def post(server, path, body, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=30, **kwargs)


def check_error(r: httpx.Response, status: int, *needles: str, param: str | None = None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["type"], str) and error["type"]
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    if param is not None:
        assert error["param"] == param
    return error


def completion(**fields) -> dict:
    return {"model": "fake-base", "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], **fields}


# -- 401 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Bearer {KEY[:-1]}"},
    ],
)
def test_bad_api_key_401(server, headers):
    error = check_error(post(server, "/v1/completions", completion(), headers), 401, "API key")
    assert error["code"] == "invalid_api_key"
    r = httpx.get(server[0] + "/v1/models", headers=headers)
    check_error(r, 401, "API key")


def test_good_api_key_and_open_routes(server):
    assert post(server, "/v1/completions", completion()).status_code == 200
    assert httpx.get(server[0] + "/health").status_code == 200
    assert httpx.get(server[0] + "/metrics", headers=AUTH).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_metrics_need_the_api_key(server, headers):
    """/metrics lists the adapters' names: behind the key, as /v1/models is."""
    r = httpx.get(server[0] + "/metrics", headers=headers)
    assert check_error(r, 401, "API key")["code"] == "invalid_api_key"
    assert "ada" not in r.text


# -- 404 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [completion(model="nope"), chat(model="nope")])
def test_unknown_model_404(server, body):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    error = check_error(post(server, path, body), 404, "`nope`", param="model")
    assert error["code"] == "model_not_found"


def test_unknown_route_and_method(server):
    check_error(httpx.get(server[0] + "/v1/nothing", headers=AUTH), 404, "/v1/nothing")
    check_error(httpx.get(server[0] + "/v1/completions", headers=AUTH), 405)


def test_adapter_endpoints_disabled_without_root(tokenizer):
    with ServerThread(create_app(FakeEngine(tokenizer))) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "b"})
        check_error(r, 404, "load_lora_adapter")


# -- 400: body and parameters ----------------------------------------------------------------


def test_malformed_json_400(server):
    r = httpx.post(
        server[0] + "/v1/completions",
        content=b'{"model": "fake-base", "prompt": ',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    check_error(r, 400, "JSON")


@pytest.mark.parametrize(
    "body,param",
    [
        (completion(temperature=2.5), "temperature"),
        (completion(temperature=-1), "temperature"),
        (completion(top_p=0), "top_p"),
        (completion(top_p=1.5), "top_p"),
        (completion(n=0), "n"),
        (completion(n=100), "n"),
        (completion(max_tokens=-1), "max_tokens"),
        (completion(max_tokens="ten"), "max_tokens"),
        (completion(logprobs=21), "logprobs"),
        (completion(presence_penalty=3), "presence_penalty"),
        (completion(frequency_penalty=-3), "frequency_penalty"),
        (completion(min_p=1.5), "min_p"),
        (completion(top_k=-2), "top_k"),
        (completion(repetition_penalty=0), "repetition_penalty"),
        (completion(stop=[""]), "stop"),
        (completion(stop_token_ids=[-1]), "stop_token_ids.0"),
        (completion(prompt=[]), "prompt"),
        (completion(prompt={"text": "x"}), None),
        ({"model": "fake-base"}, "prompt"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), None),
        (chat(top_logprobs=50, logprobs=True), "top_logprobs"),
        (chat(max_completion_tokens=-1), "max_completion_tokens"),
        (chat(top_logprobs=2), None),
        ({"model": "fake-base"}, "messages"),
        (completion(logit_bias={"5": 101}), "logit_bias.5"),
        (completion(logit_bias={"x": 1}), "logit_bias"),
        (completion(prompt_logprobs=21), "prompt_logprobs"),
        (completion(suffix="!"), "suffix"),
        (completion(best_of=3), "best_of"),
        (completion(frobnicate=1), "frobnicate"),
        (chat(messages=[{"role": "user", "content": "x", "mood": 1}]), "messages.mood"),
        (chat(response_format={"type": "xml"}), "response_format.type"),
        (chat(response_format={"type": "json_schema"}), "response_format"),
        (chat(tools=[{"type": "function", "function": {"description": "x"}}]),
         "tools.0.function.name"),
        (chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
         "tools.0.function.name"),
        (chat(tool_choice="required"), "tool_choice"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools"),
        (chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={
            "type": "function", "function": {"name": "g"}}), "tool_choice"),
        (chat(guided_json={"type": "object"}, guided_regex="a+"), "guided_regex"),
        (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    ],
)  # fmt: skip
def test_out_of_range_or_malformed_400(server, body, param):
    path = "/v1/completions" if "prompt" in body or param == "prompt" else "/v1/chat/completions"
    error = check_error(post(server, path, body), 400)
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"]


def test_non_object_body_400(server):
    check_error(post(server, "/v1/completions", [1, 2, 3]), 400)


def test_context_overflow_400(server):
    error = check_error(
        post(server, "/v1/completions", completion(prompt="word " * 30, max_tokens=60)),
        400,
        "maximum context length is 64 tokens",
        "60 in the completion",
    )
    assert error["param"] == "max_tokens"
    check_error(post(server, "/v1/chat/completions", chat(max_tokens=70)), 400, "context length")


def test_prompt_token_out_of_vocab_400(server):
    check_error(post(server, "/v1/completions", completion(prompt=[1, 10**7])), 400, "10000000")


@pytest.fixture(scope="module")
def trusting(tokenizer):
    """A server started with --trust-request-chat-template (no key)."""
    app = create_app(FakeEngine(tokenizer), trust_request_chat_template=True)
    with ServerThread(app) as url:
        yield (url,)


def test_request_chat_template_refused_unless_trusted(server):
    body = chat(chat_template="{{ messages[0].content }}")
    error = check_error(post(server, "/v1/chat/completions", body), 400, "--trust-request")
    assert error["param"] == "chat_template"


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{{ raise_exception('only system messages here') }}", "only system messages here"),
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{% for i in range(10**9) %}{% endfor %}", "OverflowError"),  # the sandbox's range cap
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
         "the template"),  # over its operations or its time, whichever comes first
        ("{{ 'x' * 10 }}{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}", "exceeds"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__"),
        ("{% if %}", "does not compile"),
    ],
)  # fmt: skip
def test_request_chat_template_bounded_when_trusted(trusting, template, needle):
    """Errors name the template; loops, output and time are bounded; the sandbox holds."""
    error = check_error(post(trusting, "/v1/chat/completions", chat(chat_template=template)), 400)
    assert error["param"] == "chat_template" and needle in error["message"], error
    assert httpx.get(trusting[0] + "/health").status_code == 200


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "template", "self"])
def test_reserved_chat_template_kwargs_refused(server, name):
    body = chat(chat_template_kwargs={name: "x"})
    check_error(post(server, "/v1/chat/completions", body), 400, name)


def test_unknown_fields_allowed_by_flag(tokenizer):
    app = create_app(FakeEngine(tokenizer), allow_unknown_fields=True)
    with ServerThread(app) as url:
        r = post((url,), "/v1/completions", completion(frobnicate=1), headers={})
        assert r.status_code == 200, r.text
        r = post((url,), "/v1/completions", completion(suffix="!"), headers={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


# -- 503 -------------------------------------------------------------------------------------


def test_queue_full_503_with_retry_after(server):
    url, engine = server[0], server[1]
    body = completion(prompt="busy", max_tokens=50, stream=True)
    engine.step_s = 0.05  # the busy request runs for 2.5 s
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as busy:
            lines = busy.iter_lines()  # kept referenced: dropping it closes the connection
            assert next(lines).startswith("data:") and engine.running
            r = post(server, "/v1/completions", completion())
            check_error(r, 503, "queue full")
            assert int(r.headers["Retry-After"]) >= 1
    finally:
        engine.step_s = 0.005


# -- adapters: 403 / 400 / 404 -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["../outside", "/etc", "sneaky", "good/../../x"])
def test_adapter_path_outside_root_403(server, path):
    body = {"lora_name": "evil", "lora_path": path}
    check_error(post(server, "/v1/load_lora_adapter", body), 403, "outside the adapter root")
    assert "evil" not in server[1].loras


def test_adapter_absolute_outside_path_403(server):
    body = {"lora_name": "evil", "lora_path": str(server[3])}
    check_error(post(server, "/v1/load_lora_adapter", body), 403, str(server[3]))


def test_adapter_invalid_files_400(server):
    body = {"lora_name": "bad", "lora_path": "empty"}
    check_error(post(server, "/v1/load_lora_adapter", body), 400, "adapter_config.json", "bad")


def test_adapter_load_bodies_400(server):
    check_error(post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    body = {"lora_name": "", "lora_path": "good"}
    check_error(post(server, "/v1/load_lora_adapter", body), 400, "lora_name")


def test_adapter_duplicate_name_400(server):
    body = {"lora_name": "ada", "lora_path": "good"}
    check_error(post(server, "/v1/load_lora_adapter", body), 400, "already", param="lora_name")


def test_unload_unknown_adapter_404(server):
    check_error(post(server, "/v1/unload_lora_adapter", {"lora_name": "ghost"}), 404, "ghost")


def test_never_500_on_garbage(server):
    """A spread of junk bodies: all 4xx, all in OpenAI's format."""
    junk = [None, "text", 3, {"prompt": None}, {"messages": "hi"}, {"stream": "maybe"}]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        for body in junk:
            r = httpx.post(server[0] + path, content=json.dumps(body), headers=AUTH)
            assert 400 <= r.status_code < 500, (path, body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
