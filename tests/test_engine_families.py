"""The engine on Gemma 2 / 3, Phi-3 and Granite against transformers + PEFT: one generate()
mixes the base model and two PEFT adapters (Phi-3's on its fused qkv_proj / gate_up_proj) in
the same steps; prompt logprobs match PEFT's teacher-forced log-softmax within 1e-4 and greedy
tokens match PEFT's generate, for every request (where they differ, each of ours is PEFT's
choice up to a tie within 1e-4: Gemma's logit softcapping makes near-exact ties)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.export import export_model
from ort_lora.export.tiny import save_random_adapters, tiny_config, write_random_checkpoint

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from peft_cases import assert_output_matches_peft  # noqa: E402 (after the importorskips)
from test_engine_peft import MAX_NEW, _oracle  # noqa: E402

ATTENTION = {
    "phi3": ["qkv_proj", "o_proj"],  # PEFT's names on Phi-3: the fused module
    "default": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
# prompts of at most 16 tokens: Phi-3's teacher-forced oracle stays below its original
# context (16, where its LongRoPE switches factors); generation crosses it
PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 120, 64, 33, 21, 9], [200, 150, 100, 50, 25], [7] * 16]


def _adapters(family: str) -> dict[str, dict]:
    fused = family == "phi3"
    return {
        "attn4": dict(
            r=4, lora_alpha=8, target_modules=ATTENTION.get(family, ATTENTION["default"])
        ),
        "all8": dict(
            r=8,
            lora_alpha=16,
            target_modules="all-linear",
            rank_pattern={"gate_up_proj" if fused else "gate_proj": 4},
            alpha_pattern={"model.layers.1.self_attn." + ("qkv_proj" if fused else "q_proj"): 32},
        ),
    }


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "phi3", "granite"])
def family_setup(request, tmp_path_factory):
    """(export dir, transformers model, {adapter name: (PEFT model, adapter dir)})."""
    from transformers import AutoModelForCausalLM

    family, root = request.param, tmp_path_factory.mktemp(request.param)
    ckpt = write_random_checkpoint(root / "ckpt", tiny_config(family), seed=21)
    out = export_model(ckpt, root / "export", block_size=8, progress=False)
    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    dirs = save_random_adapters(base, root, _adapters(family), seed=300)
    adapters = {
        name: (peft.PeftModel.from_pretrained(copy.deepcopy(base), d).eval(), d)
        for name, d in dirs.items()
    }
    return out, base, adapters


def test_mixed_batch_matches_peft(family_setup):
    out, base, adapters = family_setup
    names = [None, *adapters]
    requests = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]
    loras = {n: LoRARequest(n, i + 1, str(adapters[n][1])) for i, n in enumerate(adapters)}
    llm = LLM(out, num_pages=128, max_loras=len(adapters))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        params,
        lora_request=[loras.get(n) for _, n in requests],
    )
    models = {None: base} | {n: model for n, (model, _) in adapters.items()}
    worst = 0.0
    for (prompt, name), result in zip(requests, outs, strict=True):
        oracle = _oracle(models[name], prompt)  # [P, vocab] logprobs, PEFT's greedy tokens
        if name is not None:  # the comparison would not see an adapter that does nothing
            assert np.abs(oracle[0] - _oracle(base, prompt)[0]).max() > 1e-2
        worst = max(worst, assert_output_matches_peft(models[name], prompt, result, name, oracle))
    assert worst <= 1e-4, f"max |prompt logprob - PEFT's| = {worst:.3g}"
