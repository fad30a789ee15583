"""A DoRA adapter trained like the demo adapters (scripts/train_demo_adapters.py --tasks upper
--dora: SmolLM2-135M-Instruct, rank 8, use_dora) served by ort-lora: on the held-out prompts the
training run evaluated with PEFT (metrics.json: upper_dora), ort-lora's greedy answers succeed
at the same rate as PEFT's own inference, and the recorded example answers are the same text.
"""

from __future__ import annotations

import json

import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.demo.tasks import ADAPTERS_DIR, TASKS

pytestmark = pytest.mark.slow
DORA_DIR = ADAPTERS_DIR / "upper_dora"


def test_the_smollm2_dora_adapter_succeeds_as_with_peft(smollm2_export):
    if not (DORA_DIR / "adapter_config.json").is_file():
        pytest.fail(f"{DORA_DIR} is missing: scripts/train_demo_adapters.py --tasks upper --dora")
    recorded = json.loads((ADAPTERS_DIR / "metrics.json").read_text())["upper_dora"]
    assert recorded["config"]["dora"] and recorded["base_success"] <= 0.2
    task = TASKS["upper"]
    prompts = task.make_prompts(recorded["eval_prompts"], seed=1234, split="eval")
    llm = LLM(smollm2_export, max_loras=1)
    tok = llm.get_tokenizer()
    ids = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], True),
                   add_special_tokens=False)
        for p in prompts
    ]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24)
    lora = LoRARequest("upper_dora", 1, str(DORA_DIR))
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, lora)
    answers = [o.outputs[0].text for o in outs]
    assert llm.engine.registry.is_dora("upper_dora")
    success = sum(map(task.check, prompts, answers)) / len(prompts)
    print(
        f"upper_dora held-out success: ort-lora {success:.3f}, PEFT {recorded['adapter_success']}"
    )
    assert success == recorded["adapter_success"]
    for example, answer in zip(recorded["examples"], answers, strict=False):
        assert answer.strip() == example["adapter"].strip(), example["prompt"]
