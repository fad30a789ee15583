"""Faults inside the engine (injected by the tests): a failed model step is isolated (its
entries rerun in halves): a transient fault fails nobody, a request whose row makes the model
raise fails alone, and however many such requests come the engine serves on; a fault in one
request's output fails only that request; a model that keeps failing (even on the probe step
no request reaches) stops the engine, and then every request it held or receives is answered
503, none hangs, and /health says why.
A model whose output layer is larger than its tokenizer samples a padding id and serves on.
(tests/test_step_isolation.py checks the isolation itself on a busy batch.)"""

from __future__ import annotations

import threading

import httpx
import pytest
from reliability_server import GREEDY, TIMEOUT_S, serve

from ort_lora.engine.request import Completion

LONG = {"prompt": [9, 8, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}


def in_threads(fn, args_list) -> list:
    """fn(*args) for each args on its own thread; their results, in order."""
    results = [None] * len(args_list)

    def run(i):
        results[i] = fn(*args_list[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 5)
    assert not any(t.is_alive() for t in threads), "a request was never answered"
    return results


def test_a_model_step_that_fails_once_fails_nobody(served, monkeypatch):
    """The rerun of the failed step's entry succeeds: the request returns its usual text."""
    session = served.engine.engine.runner.session
    run, calls = session.run, []

    def fails_once(inputs, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the model step failed")
        return run(inputs, **kw)

    monkeypatch.setattr(session, "run", fails_once)
    r = served.post("/v1/completions", {"model": served.base, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == served.reference and len(calls) > 1
    served.assert_serving()


def poison_prompts(monkeypatch, served, first_token: int) -> None:
    """Make every model run raise, as a kernel would, that holds the first chunk of a prompt
    starting with `first_token` (a hostile request's row)."""
    runner = served.engine.engine.runner
    run = runner.run

    def faulty(plan, times=None):
        if any(e.start_pos == 0 and e.token_ids[0] == first_token for e in plan.entries):
            raise RuntimeError("injected: LoraSGMV found a non-finite weight")
        return run(plan, times)

    monkeypatch.setattr(runner, "run", faulty)


def test_requests_that_make_the_model_fail_never_stop_the_engine(served, monkeypatch):
    """More hostile requests in a row than MAX_STEP_FAILURES, each alone on an idle server
    (every entry of its steps fails alone; the probe step runs): each gets a 500 with an
    error id, and the server stays healthy with its greedy output unchanged."""
    from ort_lora.engine.llm_engine import MAX_STEP_FAILURES

    poison_prompts(monkeypatch, served, 250)
    for adapter in [served.base, "qv", "mlp", served.base, "qv"][: MAX_STEP_FAILURES + 2]:
        r = served.post("/v1/completions", {"model": adapter, **LONG, "prompt": [250, 1, 2]})
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "internal_error" and "internal error" in error["message"]
        assert "injected" not in r.text and "RuntimeError" not in r.text  # logged, not sent
        assert httpx.get(served.url + "/health", timeout=TIMEOUT_S).status_code == 200
    served.assert_serving()


def test_a_hostile_request_in_a_batch_fails_alone(served, monkeypatch):
    """A hostile request sent with others: they return what they return alone."""
    alone = served.post("/v1/completions", {"model": "qv", **LONG}).json()["choices"][0]
    poison_prompts(monkeypatch, served, 250)
    good = {"model": "qv", **LONG}
    bad = {"model": "qv", **LONG, "prompt": [250, 1, 2]}
    results = in_threads(served.post, [("/v1/completions", b) for b in [good, bad, good, bad]])
    assert [r.status_code for r in results] == [200, 500, 200, 500], [r.text for r in results]
    assert all(r.json()["choices"][0]["text"] == alone["text"] for r in results[::2])
    served.assert_serving()


def test_fault_in_one_request_fails_it_alone(served, monkeypatch):
    """Two requests batched together; a fault while processing one's tokens (it asks for
    prompt [77, ...]) fails it alone; the other returns what it returns alone."""
    add_token = Completion.add_token

    def faulty(self, token, eos):
        if self.seq.prompt_token_ids[0] == 77:
            raise ValueError("injected: this request's output failed")
        return add_token(self, token, eos)

    alone = served.post("/v1/completions", {"model": served.base, **LONG}).json()
    monkeypatch.setattr(Completion, "add_token", faulty)
    bad = {"model": served.base, **LONG, "prompt": [77, 1, 2]}
    good = {"model": served.base, **LONG}
    r_bad, r_good = in_threads(served.post, [("/v1/completions", bad), ("/v1/completions", good)])
    assert r_bad.status_code == 500 and "injected" not in r_bad.text, r_bad.text
    assert r_good.status_code == 200, r_good.text
    assert r_good.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    monkeypatch.undo()
    served.assert_serving()


def test_steps_that_keep_failing_stop_the_engine_and_answer_everyone(
    tiny_llama_export, adapter_root, monkeypatch
):
    """Every model run fails, the probe step's too: the requests of the first failed steps
    get 500, then the engine stops (3 in a row): every request still held, and every later
    one, gets 503, and /health says why. One sequence per step, so that at most 3 of the 6
    requests run in the 3 failed steps."""
    with serve(tiny_llama_export, adapter_root, max_num_seqs=1) as served:
        session = served.engine.engine.runner.session

        def broken(inputs, **kw):
            raise RuntimeError("injected: the device is gone")

        monkeypatch.setattr(session, "run", broken)
        body = {"model": served.base, **LONG}
        results = in_threads(served.post, [("/v1/completions", body)] * 6)
        codes = [r.status_code for r in results]
        assert set(codes) <= {500, 503} and codes.count(503) >= 3, [r.text for r in results]
        health = httpx.get(served.url + "/health", timeout=TIMEOUT_S)
        assert health.status_code == 503, health.text
        assert "3 steps in a row failed, not because of any one request" in health.text
        later = served.post("/v1/completions", body)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_unavailable"
        assert "injected" not in later.text


@pytest.fixture(scope="module")
def padded_export(tmp_path_factory):
    """A tiny Llama whose output layer has 256 rows but whose tokenizer knows 200 ids, with
    the LM head rows of the known ids zeroed: greedy decoding picks a padding id."""
    from safetensors.numpy import load_file, save_file

    from ort_lora.export import export_model
    from ort_lora.export.tiny import tiny_config, write_random_checkpoint
    from ort_lora.export.tiny_tokenizer import write_byte_tokenizer

    root = tmp_path_factory.mktemp("padded")
    ckpt = write_random_checkpoint(root / "ckpt", tiny_config("llama"), seed=7)
    write_byte_tokenizer(ckpt, 200)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"][:200] = 0.0
    save_file(tensors, str(ckpt / "model.safetensors"))
    return export_model(ckpt, root / "export", block_size=8, progress=False)


def test_padding_ids_decode_as_no_text(padded_export):
    from ort_lora import LLM, SamplingParams

    llm = LLM(padded_export, num_pages=32)
    assert llm.get_tokenizer().vocab_size == 200 and llm.engine.manifest.vocab_size == 256
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 210]}, params)[0].outputs[0]
    assert len(out.token_ids) == 6 and all(t >= 200 for t in out.token_ids)
    assert out.text == "" and out.finish_reason == "length"
    assert all(lp[t].decoded_token == "" for t, lp in zip(out.token_ids, out.logprobs))
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]  # still serving
    assert again.finished
