"""Hostile chat templates over HTTP: an adapter's template files linked outside the adapter
root, oversized or swapped after loading; request templates (--trust-request-chat-template)
that would build huge values or emit a lone surrogate. Each is a 4xx naming the file or the
bound, never a 500; no file outside the root is ever rendered; the server keeps serving.

The server here is this module's own (its own engine, on the tiny Llama): it trusts request
templates and has the Hermes tool-call parser, which the suite's shared server does not."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from reliability_server import TIMEOUT_S, Served

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app
from ort_lora.server.adapter_templates import MAX_TEMPLATE_FILE_BYTES

SECRET = "SECRET-LINE-" * 4
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def trusting(tiny_llama_export, adapter_root, tmp_path_factory):
    """A server trusting request templates, with its own adapter root holding a copy of "qv"."""
    from ort_lora.engine.async_engine import AsyncEngine

    root = tmp_path_factory.mktemp("template_adapters")
    shutil.copytree(adapter_root / "qv", root / "qv")
    engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=64, max_model_len=64)
    app = create_app(engine, adapter_root=root, trust_request_chat_template=True,
                     tool_call_parser="hermes")  # fmt: skip
    with ServerThread(app) as url:
        served = Served(url, engine, root, engine.model_name)
        served.reference = served.greedy_text()
        yield served


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """Template files outside the adapter root whose template prints SECRET."""
    out = tmp_path_factory.mktemp("outside_templates")
    (out / "chat_template.jinja").write_text(SECRET)
    for name in ("tokenizer_config.json", "chat_template.json"):
        (out / name).write_text(json.dumps({"chat_template": SECRET}))
    return out


def adapter(served: Served, name: str, template: str | None = None):
    """A copy of "qv" under the root, with `template` in its chat_template.jinja."""
    d = served.root / name
    shutil.copytree(served.root / "qv", d)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def load(served: Served, name: str) -> httpx.Response:
    return served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})


def rendered(served: Served, model: str, **body) -> tuple[httpx.Response, str]:
    """/tokenize of MESSAGES, and the text its tokens detokenize to ("" if refused)."""
    r = served.post("/tokenize", {"model": model, "messages": MESSAGES, **body})
    if r.status_code != 200:
        return r, ""
    text = served.post("/detokenize", {"model": model, "tokens": r.json()["tokens"]})
    return r, text.json()["prompt"]


@pytest.mark.parametrize("name", TEMPLATE_FILES)
def test_template_linked_outside_the_root_refuses_the_load(trusting, outside, name):
    d = adapter(trusting, f"out-{name}")
    os.symlink(outside / name, d / name)
    r = load(trusting, f"out-{name}")
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert f"{name} resolves outside the adapter root" in error["message"], error
    assert "SECRET" not in r.text and str(outside) not in r.text
    trusting.assert_serving()


@pytest.mark.parametrize("name", TEMPLATE_FILES)
def test_template_linked_outside_after_loading_is_never_rendered(trusting, outside, name):
    d = adapter(trusting, f"swap-{name}")
    assert load(trusting, f"swap-{name}").status_code == 200
    os.symlink(outside / name, d / name)  # swapped in after the load's check, before first use
    r, text = rendered(trusting, f"swap-{name}")
    assert r.status_code in (200, 400), r.text  # the model's template serves, if it has one
    assert "SECRET" not in r.text and "SECRET" not in text
    trusting.assert_serving()


def test_oversized_template_file_refuses_the_load(trusting):
    d = adapter(trusting, "big")
    with open(d / "chat_template.jinja", "wb") as f:
        f.truncate(64 << 20)  # sparse
    r = load(trusting, "big")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"chat_template.jinja is larger than its limit of {MAX_TEMPLATE_FILE_BYTES}" in message
    trusting.assert_serving()


def test_unloading_drops_the_cached_template(trusting):
    d = adapter(trusting, "cycle", "FIRST {{ messages[0].content }}")
    assert load(trusting, "cycle").status_code == 200
    assert rendered(trusting, "cycle")[1] == "FIRST hi"
    r = trusting.post("/v1/unload_lora_adapter", {"lora_name": "cycle"})
    assert r.status_code == 200, r.text
    (d / "chat_template.jinja").write_text("SECOND {{ messages[0].content }}")
    assert load(trusting, "cycle").status_code == 200
    assert rendered(trusting, "cycle")[1] == "SECOND hi"
    trusting.assert_serving()


# request template -> the words its 400 names
HOSTILE_REQUEST_TEMPLATES = {
    "repeat": ("{{ 'a' * 10**9 }}", "MAX_TEMPLATE_CHARS"),
    "power": ("{{ 7 ** 6000000 }}", "MAX_TEMPLATE_INT_BITS"),
    "~ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "MAX_TEMPLATE_CHARS"),
    "lone surrogate": ("{{ '\\ud800' }}", "lone surrogate"),
}  # fmt: skip


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize("case", list(HOSTILE_REQUEST_TEMPLATES))
def test_hostile_request_template_is_a_400_naming_the_bound(trusting, route, case):
    template, needle = HOSTILE_REQUEST_TEMPLATES[case]
    body = {"model": trusting.base, "messages": MESSAGES, "chat_template": template}
    if route != "/tokenize":
        body["max_tokens"] = 1
    r = httpx.post(trusting.url + route, json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and needle in error["message"], error
    trusting.assert_serving()
