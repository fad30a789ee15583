"""Bounds before work (server/limits.py): a body over --max-request-bytes is refused with 413
as it streams in; a prompt longer than the context could hold is refused before it is
tokenized; every list a request carries is bounded (400 naming the field); number fields take
JSON numbers only; /metrics is behind the API key. After each group the server serves on."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from reliability_server import MAX_MODEL_LEN, TIMEOUT_S

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app
from ort_lora.server.cli import build_parser
from ort_lora.server.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_CONSTRAINT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
LIMIT = DEFAULT_MAX_REQUEST_BYTES


def cmpl(**fields) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def post(served, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(served.url + path, content=content, headers=headers, timeout=TIMEOUT_S)


def check_400(r: httpx.Response, param: str, needle: str = "") -> dict:
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert needle in error["message"], error
    return error


# -- the body limit ---------------------------------------------------------------------------


def raw_request(url: str, head: str, chunks=(), read_timeout_s: float = 10.0) -> bytes:
    """Send a request's head and `chunks` on a raw socket, then read whatever the server
    answers within `read_timeout_s` (b"" if nothing: it is still waiting for the body)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            sock.sendall(chunk)
        sock.settimeout(read_timeout_s)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except TimeoutError:
            pass
        return answer


def test_a_body_over_the_limit_is_413(served):
    body = json.dumps(cmpl(prompt="x" * (LIMIT + 1000))).encode()
    r = post(served, CMPL, body)
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert str(LIMIT) in error["message"] and "--max-request-bytes" in error["message"]
    assert error["code"] == "request_too_large"
    served.assert_serving()


def test_a_declared_length_over_the_limit_is_refused_before_the_body(served):
    """Content-Length says 8 MiB: 413 at once, no byte of the body sent."""
    head = (
        f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {2 * LIMIT}\r\n\r\n"
    )
    answer = raw_request(served.url, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-request-bytes" in answer
    served.assert_serving()


def test_a_streamed_body_is_refused_as_its_count_passes_the_limit(served):
    """A chunked body with no length: 413 once past the limit, while the client has not
    finished sending it (the server never holds more than the limit)."""
    head = (
        f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    count = LIMIT // len(piece) + 2  # past the limit; the terminating chunk is never sent
    answer = raw_request(served.url, head, [chunk] * count)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    served.assert_serving()


def test_the_limit_is_a_flag():
    assert build_parser().parse_args([]).max_request_bytes == LIMIT
    assert build_parser().parse_args(["--max-request-bytes", "65536"]).max_request_bytes == 65536
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-request-bytes", "0"])


def test_a_smaller_limit_applies(served):
    """A second app over the suite's engine (it generates only on its own server's loop:
    /tokenize, which does not generate, shows the limit)."""
    app = create_app(served.engine, manage_engine=False, max_request_bytes=4096)
    with ServerThread(app) as url:
        r = httpx.post(url + "/tokenize", json={"prompt": "y" * 5000}, timeout=TIMEOUT_S)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
        r = httpx.post(url + "/tokenize", json={"prompt": "y" * 50}, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text


# -- prompts bounded before they are tokenized --------------------------------------------------


@pytest.fixture
def encodes(served, monkeypatch) -> list:
    """Every call of the engine's tokenizer's encode functions."""
    calls, tok = [], served.engine.tokenizer
    for name in ("encode", "encode_releasing_gil"):
        real = getattr(tok, name, None)

        def counted(*args, _real=real, **kwargs):
            calls.append(args)
            return _real(*args, **kwargs)

        monkeypatch.setattr(tok, name, counted, raising=False)
    return calls


def test_a_prompt_longer_than_the_context_could_hold_is_not_tokenized(served, encodes):
    """Over the bound: 400 naming `prompt`, the tokenizer never called; a prompt that fits
    the context is served as before."""
    tok = served.engine.tokenizer
    r = post(served, CMPL, cmpl(prompt="z" * (MAX_MODEL_LEN * tok.max_token_bytes * 4 + 1)))
    check_400(r, "prompt", "characters")
    assert encodes == []
    r = post(served, "/tokenize", {"prompt": "z" * 100_000})
    check_400(r, "prompt")
    assert encodes == []
    fits = "ab" * (MAX_MODEL_LEN // 4)
    r = post(served, CMPL, cmpl(prompt=fits, max_tokens=2))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < MAX_MODEL_LEN


def test_a_prompt_of_a_list_is_bounded_too(served, encodes):
    r = post(served, CMPL, cmpl(prompt=["short", "z" * 100_000]))
    check_400(r, "prompt")
    assert encodes == []


def test_chat_messages_longer_than_the_context_could_hold_are_not_rendered(served, encodes):
    messages = [{"role": "user", "content": "m" * 1000} for _ in range(20)]
    check_400(post(served, CHAT, chat(messages=messages)), "messages", "characters")
    assert encodes == []


def test_token_ids_past_the_context_are_refused_by_name(served):
    check_400(post(served, CMPL, cmpl(prompt=[5] * (MAX_MODEL_LEN + 1))), "prompt")
    check_400(post(served, "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}), "tokens")
    served.assert_serving()


# -- list limits --------------------------------------------------------------------------------

BIG_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string"} for i in range(MAX_CONSTRAINT_CHARS // 20)},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
LISTS = {
    "messages": (CHAT, chat(messages=[{"role": "user", "content": ""}] * (MAX_MESSAGES + 1))),
    "stop_token_ids": (CMPL, cmpl(stop_token_ids=[2] * (MAX_STOP_TOKEN_IDS + 1))),
    "logit_bias": (CMPL, cmpl(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)})),
    "tools": (
        CHAT,
        chat(tools=[{**TOOL, "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)],
             tool_choice="none"),
    ),
    "guided_json": (CMPL, cmpl(guided_json=BIG_SCHEMA)),
    "guided_regex": (CMPL, cmpl(guided_regex="a" * (MAX_CONSTRAINT_CHARS + 1))),
    "guided_choice": (CMPL, cmpl(guided_choice=["c" * 1000] * 70)),
    "structured_outputs.grammar": (
        CMPL, cmpl(structured_outputs={"grammar": "g" * (MAX_CONSTRAINT_CHARS + 1)}),
    ),
    "response_format.json_schema.schema": (
        CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}),
    ),
    "tools.0.function.parameters": (
        CHAT, chat(tools=[{**TOOL, "function": {"name": "f", "parameters": BIG_SCHEMA}}]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("field", list(LISTS))
def test_each_list_and_constraint_is_bounded(served, field):
    path, body = LISTS[field]
    r = post(served, path, body)
    check_400(r, field, "at most")
    served.assert_serving()


# -- strict number types ------------------------------------------------------------------------

STRICT = {
    "adapters.0.weight true": (cmpl(adapters=[{"name": "qv", "weight": True}]), "adapters.0"),
    'adapters.0.weight "1"': (cmpl(adapters=[{"name": "qv", "weight": "1"}]), "adapters.0"),
    'temperature "1"': (cmpl(temperature="1"), "temperature"),
    "top_p true": (cmpl(top_p=True), "top_p"),
    "max_tokens 4.0": (cmpl(max_tokens=4.0), "max_tokens"),
    "n true": (cmpl(n=True), "n"),
    'seed "7"': (cmpl(seed="7"), "seed"),
    "stream 1": (cmpl(stream=1), "stream"),
    "logit_bias key of Arabic-Indic digits": (cmpl(logit_bias={"١٢": 1}), "logit_bias"),
    "logit_bias key of fullwidth digits": (cmpl(logit_bias={"１": 1}), "logit_bias"),
}


@pytest.mark.parametrize("case", list(STRICT))
def test_numbers_are_json_numbers(served, case):
    body, param = STRICT[case]
    r = post(served, CMPL, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_a_float_field_takes_an_integer_but_not_true(served):
    body = cmpl(adapters=[{"name": "qv", "weight": 1}], temperature=0, top_p=1)
    assert post(served, CMPL, body).status_code == 200
    body["adapters"][0]["weight"] = True
    assert post(served, CMPL, body).status_code == 400


# -- /metrics behind the key --------------------------------------------------------------------

KEY = "sk-limits"


@pytest.mark.parametrize("open_metrics", [False, True])
def test_metrics_need_the_key_unless_allowed(served, open_metrics):
    app = create_app(
        served.engine, api_key=KEY, manage_engine=False,
        allow_unauthenticated_metrics=open_metrics,
    )  # fmt: skip
    with ServerThread(app) as url:
        anonymous = httpx.get(url + "/metrics", timeout=TIMEOUT_S)
        keyed = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200 and "lora" in keyed.text
        if open_metrics:
            assert anonymous.status_code == 200
        else:
            assert anonymous.status_code == 401, anonymous.text
            assert anonymous.json()["error"]["code"] == "invalid_api_key"
            assert "qv" not in anonymous.text
        assert httpx.get(url + "/v1/models", timeout=TIMEOUT_S).status_code == 401


def test_a_text_over_the_strict_bound_has_more_tokens_than_the_context(served):
    """The bound's premise on the suite's tokenizer: a text of more than max_model_len x
    max_token_bytes characters (the bound without its margin) tokenizes to more than
    max_model_len tokens; the GIL-releasing encode gives the same ids as encode."""
    tok = served.engine.tokenizer
    strict = MAX_MODEL_LEN * tok.max_token_bytes
    for text in ["a" * (strict + 1), "hello, world! " * (strict // 14 + 1), "<s>" * strict]:
        ids = tok.encode_releasing_gil(text)
        assert ids == tok.encode(text)
        assert len(ids) > MAX_MODEL_LEN, (text[:20], len(ids))
