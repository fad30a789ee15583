"""A quantized base with float32 LoRA adapters (QLoRA serving) against PEFT on the same
numbers: the tiny Llama exported as int4 and int8, the base and three PEFT adapters of
tests/test_engine_peft.py in one mixed generate() call. PEFT runs on the export's dequantized
weights (and int8 inputs of its base layers at accuracy_level 4; LoRA's A and B see the float
input, as LoraSGMV does). Tolerances: quant_cases.py."""

from __future__ import annotations

import numpy as np
import pytest
from quant_cases import assert_rows_match, reference
from test_engine_peft import (  # noqa: F401 (adapter_dirs: a fixture)
    ADAPTERS,
    PROMPTS,
    _lora,
    _oracle,
    _peft_model,
    adapter_dirs,
    assert_greedy_matches,
)

from ort_lora import LLM, SamplingParams

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

MAX_NEW = 8


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("level", [0, 4])
def test_mixed_batch_matches_peft_on_dequantized_weights(
    tiny_quant_export,
    tiny_llama_checkpoint,
    adapter_dirs,  # noqa: F811 (the fixture of test_engine_peft)
    weights,
    level,
):
    """8 requests (base + 3 adapters, twice) in one call: prompt logprobs of every position
    against PEFT's teacher-forced log-softmax; at accuracy_level 0 the greedy tokens too."""
    out = tiny_quant_export(weights, level)
    base = reference(tiny_llama_checkpoint, out)
    names = [None, *ADAPTERS]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]
    llm = LLM(out, num_pages=256, max_loras=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        params,
        lora_request=[_lora(n, adapter_dirs) for _, n in requests],
    )
    models = {None: base} | {n: _peft_model(base, adapter_dirs[n]) for n in ADAPTERS}
    ours, want = [], []
    for (prompt, name), result in zip(requests, outs):
        logp, greedy = _oracle(models[name], prompt)
        for pos, entry in enumerate(result.prompt_logprobs[1:]):
            assert prompt[pos + 1] in entry, f"{name}: position {pos + 1} lacks the actual token"
            tokens = sorted(entry)
            ours.append(np.array([entry[t].logprob for t in tokens]))
            want.append(logp[pos, tokens])
        if level == 0:
            assert_greedy_matches(models[name], prompt, result.outputs[0].token_ids, greedy)
    assert_rows_match(ours, want, level)


def test_adapters_change_the_quantized_output(tiny_quant_export, adapter_dirs):  # noqa: F811
    llm = LLM(tiny_quant_export("int4", 4), num_pages=256)
    names = [None, *ADAPTERS]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[1]}] * len(names),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        lora_request=[_lora(n, adapter_dirs) for n in names],
    )
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(names)
