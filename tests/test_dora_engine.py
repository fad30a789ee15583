"""DoRA adapters end to end: the engine (unchanged: the registry computes the scale rows from
the export's own weights) against transformers + PEFT with the DoRA adapters loaded.

One generate() call on the tiny random Llama export mixes base requests, a plain LoRA adapter
and two DoRA adapters (rank 4 on q/v with a rank_pattern; rank 8 rslora on every module with an
alpha_pattern): prompt logprobs match PEFT's teacher-forced log-softmax within 1e-4 and greedy
tokens equal PEFT's generate, request by request.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.export.tiny import save_random_adapters

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from peft_cases import ALL_LINEAR, assert_matches_peft, peft_models  # noqa: E402
from test_engine_peft import MAX_NEW, PROMPTS, _fresh, _oracle  # noqa: E402

ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "dora_qv": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        use_dora=True,
        rank_pattern={"model.layers.1.self_attn.v_proj": 2},
    ),  # fmt: skip
    "dora_all_rs": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL_LINEAR,
        use_dora=True,
        use_rslora=True,
        alpha_pattern={"down_proj": 4},
    ),  # fmt: skip
}
DORA = ("dora_qv", "dora_all_rs")


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    return save_random_adapters(
        hf_model, tmp_path_factory.mktemp("dora_engine"), ADAPTERS, seed=300
    )


def _lora(name, dirs):
    return (
        None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1, str(dirs[name]))
    )


def test_dora_in_a_mixed_batch_matches_peft(tiny_llama_export, hf_model, adapter_dirs):
    names = [None, *ADAPTERS]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]
    llm = LLM(tiny_llama_export, num_pages=256, max_loras=4)
    loras = [_lora(n, adapter_dirs) for _, n in requests]
    models = peft_models(hf_model, adapter_dirs, ADAPTERS)
    worst = assert_matches_peft(llm, requests, loras, models, MAX_NEW)
    assert llm.engine.registry.is_dora("dora_qv") and not llm.engine.registry.is_dora("qv4")
    print(f"largest |prompt logprob - PEFT|: {worst:.2e}")


def test_dora_scale_matters(tiny_llama_export, hf_model, adapter_dirs, tmp_path):
    """PEFT's plain LoRA with the same A and B (DoRA switched off) differs from what we serve:
    the scale, not only the LoRA part, reaches the output."""
    llm = LLM(tiny_llama_export, num_pages=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params,
                       lora_request=[_lora("dora_all_rs", adapter_dirs)])[0]  # fmt: skip
    plain = peft.PeftModel.from_pretrained(_fresh(hf_model), adapter_dirs["dora_all_rs"])
    with torch.no_grad():  # the same A, B as plain LoRA: drop the magnitude's effect
        for module in plain.modules():
            if hasattr(module, "lora_magnitude_vector"):
                module.use_dora["default"] = False
                module.lora_variant.pop("default", None)
    logp, _ = _oracle(plain.eval(), PROMPTS[1])
    ours = np.array([e[PROMPTS[1][i + 1]].logprob for i, e in enumerate(out.prompt_logprobs[1:])])
    want = logp[np.arange(len(ours)), PROMPTS[1][1:]]
    assert np.abs(ours - want).max() > 1e-2, "the DoRA scale must change the output"


def test_dora_on_an_int4_export_matches_peft_on_its_dequantized_weights(
    tiny_llama_checkpoint, tiny_quant_export, adapter_dirs
):
    """An int4 export (MatMulNBits, accuracy_level 0: float32 inputs): the scale comes from
    the dequantized blocks, as PEFT's DoRA computes it on a quantized base
    (dequantize_module_weight); PEFT runs on the export's own dequantized weights."""
    from quant_cases import reference

    out = tiny_quant_export("int4", 0)
    requests = [(p, name) for p in PROMPTS[:2] for name in ("dora_qv", "dora_all_rs", None)]
    llm = LLM(out, num_pages=256, max_loras=4)
    loras = [_lora(n, adapter_dirs) for _, n in requests]
    models = peft_models(reference(tiny_llama_checkpoint, out), adapter_dirs, DORA)
    worst = assert_matches_peft(llm, requests, loras, models, MAX_NEW)
    print(f"int4: largest |prompt logprob - PEFT|: {worst:.2e}")
