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

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from test_engine_peft import MAX_NEW, PROMPTS, _fresh, _oracle  # noqa: E402

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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


@pytest.fixture(scope="module")
def hf_model(tiny_llama_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    """The adapters with random A, B of unit scale and (DoRA) magnitudes off their initial
    norms by up to ~30%, so every scale matters."""
    root = tmp_path_factory.mktemp("dora_engine")
    dirs = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(300 + i)
        model = peft.get_peft_model(_fresh(hf_model), peft.LoraConfig(init_lora_weights=False,
                                                                      **kwargs))  # fmt: skip
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.5)
                if "lora_magnitude_vector" in n:
                    p.mul_(1 + 0.3 * torch.randn_like(p))
        model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def _lora(name, dirs):
    return (
        None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1, str(dirs[name]))
    )


def test_dora_in_a_mixed_batch_matches_peft(tiny_llama_export, hf_model, adapter_dirs):
    names = [None, *ADAPTERS]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]
    llm = LLM(tiny_llama_export, num_pages=256, max_loras=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        params,
        lora_request=[_lora(n, adapter_dirs) for _, n in requests],
    )
    assert llm.engine.registry.is_dora("dora_qv") and not llm.engine.registry.is_dora("qv4")
    models = {None: hf_model}
    models |= {n: peft.PeftModel.from_pretrained(_fresh(hf_model), d).eval()
               for n, d in adapter_dirs.items()}  # fmt: skip
    worst = 0.0
    for (prompt, name), out in zip(requests, outs):
        logp, greedy = _oracle(models[name], prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            assert prompt[pos + 1] in entry, f"{name}: position {pos + 1} lacks the actual token"
            for token, lp in entry.items():
                worst = max(worst, abs(lp.logprob - logp[pos, token]))
                message = f"adapter {name} pos {pos} token {token}"
                np.testing.assert_allclose(lp.logprob, logp[pos, token], atol=1e-4, err_msg=message)
        assert out.outputs[0].token_ids == greedy, f"adapter {name}: greedy tokens differ"
    print(f"largest |prompt logprob - PEFT|: {worst:.2e}")


def test_dora_scale_matters(tiny_llama_export, hf_model, adapter_dirs, tmp_path):
    """The same adapter with use_dora but its magnitudes left at their initial norms (scale 1)
    is plain LoRA: the DoRA adapters above change the tokens beyond their LoRA part."""
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
    tiny_llama_checkpoint, adapter_dirs, tmp_path
):
    """An int4 export (MatMulNBits, accuracy_level 0: float32 inputs): the scale comes from
    the dequantized blocks, as PEFT's DoRA computes it on a quantized base
    (dequantize_module_weight); PEFT runs on the export's own dequantized weights."""
    from quant_cases import export_quantized, reference

    out = export_quantized(tiny_llama_checkpoint, tmp_path / "int4", "int4", 0)
    requests = [(p, name) for p in PROMPTS[:2] for name in ("dora_qv", "dora_all_rs", None)]
    llm = LLM(out, num_pages=256, max_loras=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        params,
        lora_request=[_lora(n, adapter_dirs) for _, n in requests],
    )
    base = reference(tiny_llama_checkpoint, out)
    models = {None: base}
    models |= {n: peft.PeftModel.from_pretrained(_fresh(base), adapter_dirs[n]).eval()
               for n in ("dora_qv", "dora_all_rs")}  # fmt: skip
    for (prompt, name), got in zip(requests, outs):
        logp, greedy = _oracle(models[name], prompt)
        for pos, entry in enumerate(got.prompt_logprobs[1:]):
            for token, lp in entry.items():
                message = f"int4, adapter {name} pos {pos} token {token}"
                np.testing.assert_allclose(lp.logprob, logp[pos, token], atol=1e-4, err_msg=message)
        assert got.outputs[0].token_ids == greedy, f"int4, adapter {name}: greedy tokens differ"
