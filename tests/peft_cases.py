"""Shared by the tests against PEFT: the composition tests' adapter configs, one output checked
against PEFT, and one generate() call checked request by request."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the composition tests' adapters: two plain ones to compose (ranks, rank_pattern and scales
# differ) and a DoRA adapter (rslora), which runs alone
COMPOSE_ADAPTERS = {
    "one": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "two": dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR, rank_pattern={"o_proj": 2}),
    "dora": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
              use_dora=True, use_rslora=True),
}  # fmt: skip


def peft_models(base, dirs: dict[str, Path], names) -> dict:
    """{None: base} and name -> PeftModel of dirs[name] on a copy of base (eval mode)."""
    import peft

    models = {None: base}
    for name in names:
        models[name] = peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs[name]).eval()
    return models


def assert_output_matches_peft(model, prompt, out, label, oracle=None) -> float:
    """One greedy output with prompt_logprobs against PEFT's `model` on `prompt`: every prompt
    logprob within 1e-4 of PEFT's teacher-forced log-softmax (the actual token among them) and
    the greedy tokens PEFT's (test_engine_peft: _oracle, assert_greedy_matches; `oracle`: its
    result, when the caller has it). Returns the largest |difference|."""
    from test_engine_peft import _oracle, assert_greedy_matches

    logp, greedy = oracle or _oracle(model, prompt)
    assert out.prompt_logprobs[0] is None
    worst = 0.0
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert prompt[pos + 1] in entry, f"{label}: position {pos + 1} lacks the actual token"
        for token, lp in entry.items():
            worst = max(worst, abs(lp.logprob - logp[pos, token]))
            message = f"adapter {label} pos {pos} token {token}"
            np.testing.assert_allclose(lp.logprob, logp[pos, token], atol=1e-4, err_msg=message)
    assert_greedy_matches(model, prompt, out.outputs[0].token_ids, greedy)
    return worst


def assert_matches_peft(llm, requests, lora_requests, models, max_new: int) -> float:
    """Generates requests [(prompt ids, adapter name or None)] greedily with prompt_logprobs,
    each output checked against PEFT's models[name] (assert_output_matches_peft). Returns the
    largest |difference|."""
    from ort_lora import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, lora_requests)
    worst = 0.0
    for (prompt, name), out in zip(requests, outs, strict=True):
        worst = max(worst, assert_output_matches_peft(models[name], prompt, out, name))
    return worst


def served_lora(model, row_type: str | None):
    """A copy of a PEFT model whose LoRA A and B hold the values the pool serves for adapter
    rows of row_type (adapter_rows.served: rows of A, and rows of B^T, i.e. B's columns); a
    DoRA magnitude is no row and stays. The model itself when rows are float32."""
    import torch

    from ort_lora.adapter_rows import served

    if row_type in (None, "float32", "auto"):  # auto: float32 rows, or 16-bit ones holding them
        return model
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.from_numpy(served(p.numpy(), row_type)))
            elif "lora_B" in name:
                p.copy_(torch.from_numpy(served(p.numpy().T, row_type).T.copy()))
    return model


def pool_rows(flat: np.ndarray, offsets, features: int, row_type: str | None) -> np.ndarray:
    """float32 [len(offsets), features]: the rows of `features` values at these pool elements
    of a layer's flat pool share, as LoraSGMV reads them."""
    from ort_lora.adapter_rows import decode_rows, row_elems

    n = row_elems(features, row_type)
    rows = [flat[int(o) : int(o) + n] for o in offsets]
    if not rows:
        return np.zeros((0, features), np.float32)
    rows = np.stack(rows)
    return rows if row_type in (None, "float32") else decode_rows(rows, features, row_type)
