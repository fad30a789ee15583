"""lm-evaluation-harness against a live server: its `local-completions` model (echo +
logprobs requests, as it sends them) on a multiple-choice task defined here (a local JSON
dataset, nothing downloaded), on the tiny random Llama, for the base model and an adapter.
Oracles: the engine's prompt_logprobs run in-process (the loglikelihoods lm-eval reads back
must be them), and lm-eval's own `hf` backend (transformers + PEFT) on the same weights,
whose accuracy must be the same. Its default invocation (model and base_url alone) finds the
server's /tokenizer_info and /tokenize and tokenizes through them, offline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.bench.harness.servers import ServerThread
from ort_lora.server import create_app

lm_eval = pytest.importorskip("lm_eval")

TASK = "ortlora_mc"
WORDS = ["red", "green", "blue", "cold", "warm", "fast", "slow", "tall", "small", "dark"]


def write_task(root) -> None:
    """16 questions of 4 choices over the tiny model's byte vocabulary, and the task's YAML."""
    rng = np.random.default_rng(7)
    docs = []
    for i in range(16):
        choices = [str(w) for w in rng.choice(WORDS, 4, replace=False)]
        docs.append({"question": f"Q{i}: the {choices[0]} one is", "choices": choices,
                     "answer": int(rng.integers(4))})  # fmt: skip
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    write_task(root)
    return root


@pytest.fixture(scope="module")
def url(tiny_llama_export, tiny_qv_adapter):
    from ort_lora.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model_dir(tiny_llama_export, num_pages=256, max_model_len=256)
    engine.add_lora(LoRARequest("qv", 1, str(tiny_qv_adapter)))
    with ServerThread(create_app(engine, served_model_name="tiny")) as url:
        yield url


def evaluate(model, model_args: dict, task_dir) -> tuple[float, list[dict]]:
    """lm-eval's accuracy and its samples (each with its (context, continuation) pairs and
    the loglikelihoods it computed); `model`: a registered name, or an LM instance."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        batch_size=1,
    )
    return results["results"][TASK]["acc,none"], results["samples"][TASK]


def engine_loglikelihoods(llm, lora, encode_pair, samples) -> tuple[list, list]:
    """(what lm-eval read, what the engine's prompt_logprobs give) per (context,
    continuation) pair of `samples`, tokenized by `encode_pair` as lm-eval tokenized them."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got, want = [], []
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx, cont = encode_pair(context, continuation)
            out = llm.generate({"prompt_token_ids": ctx + cont}, params, lora_request=lora)[0]
            entries = out.prompt_logprobs[len(ctx) :]
            want.append(sum(e[t].logprob for e, t in zip(entries, cont)))
            got.append(resp[0][0])
    return got, want


@pytest.mark.parametrize("adapter", [None, "qv"])
def test_local_completions_equals_engine_and_hf(
    url, task_dir, tiny_llama_export, tiny_llama_checkpoint, tiny_qv_adapter, adapter, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    served = {"model": adapter or "tiny", "base_url": f"{url}/v1/completions",
              "tokenizer_backend": "huggingface", "tokenizer": str(tiny_llama_export),
              "max_length": 256}  # fmt: skip
    acc, samples = evaluate("local-completions", served, task_dir)

    # the loglikelihoods lm-eval read back are the engine's prompt_logprobs
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    api = LocalCompletionsAPI(**served)
    llm = LLM(tiny_llama_export, num_pages=64, max_model_len=256)
    lora = adapter and LoRARequest("qv", 1, str(tiny_qv_adapter))
    got, want = engine_loglikelihoods(llm, lora, api._encode_pair, samples)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    # lm-eval's hf backend (transformers + PEFT) scores the same and so answers the same
    hf = {"pretrained": str(tiny_llama_checkpoint), "dtype": "float32", "device": "cpu"}
    if adapter:
        hf["peft"] = str(tiny_qv_adapter)
    hf_acc, hf_samples = evaluate("hf", hf, task_dir)
    hf_lls = [r[0][0] for s in hf_samples for r in s["resps"]]
    np.testing.assert_allclose(got, hf_lls, rtol=0, atol=1e-3)
    assert acc == hf_acc
    assert [s["acc"] for s in samples] == [s["acc"] for s in hf_samples]


def test_default_invocation_tokenizes_through_the_server(url, task_dir, tiny_llama_export,
                                                         monkeypatch):  # fmt: skip
    """`--model local-completions --model_args model=tiny,base_url=...`: no tokenizer named.
    lm-eval picks its remote tokenizer (the server's /tokenizer_info and /tokenize); with
    the Hub offline, a tokenizer it tried to fetch for "tiny" would fail. Its tokens, special
    ids and loglikelihoods are the export's and the engine's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    lm = LocalCompletionsAPI(model="tiny", base_url=f"{url}/v1/completions")
    assert lm.tokenizer_backend == "remote"
    hf = AutoTokenizer.from_pretrained(tiny_llama_export)
    assert (lm.eot_token_id, lm.prefix_token_id) == (hf.eos_token_id, hf.bos_token_id)
    text = "Q1: the warm one is cold"
    assert lm.tok_encode(text) == hf(text, add_special_tokens=False).input_ids

    _, samples = evaluate(lm, {}, task_dir)
    llm = LLM(tiny_llama_export, num_pages=64, max_model_len=256)
    got, want = engine_loglikelihoods(llm, None, lm._encode_pair, samples)
    assert len(got) == 4 * 16
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
