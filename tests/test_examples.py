"""The examples run: the own-session one agrees with the engine's greedy decoding, the
own-adapter one makes a PEFT adapter and serves it."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

from ort_lora import LLM, SamplingParams

EXAMPLE = Path(__file__).parent.parent / "examples" / "own_session.py"
OWN_ADAPTER = EXAMPLE.with_name("own_adapter.py")


def test_own_session_example_matches_engine(tiny_llama_export):
    module = load_script(EXAMPLE)
    prompt = [1, 5, 17, 99, 3, 42, 8, 77, 120, 64]  # spans two blocks of 8
    tokens = module.main(
        [str(tiny_llama_export), "--tokens", "12", "--prompt-ids", ",".join(map(str, prompt))]
    )
    llm = LLM(tiny_llama_export, num_pages=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert tokens == prompt + out.outputs[0].token_ids


@pytest.mark.slow
def test_own_adapter_example_trains_saves_and_serves(smollm2_default_export, tmp_path):
    """docs/ADAPTERS.md's path: a PEFT adapter made with peft, served by `ort-lora serve
    --lora-modules`, answers under its own name (two training steps: the plumbing, not the
    learning)."""
    module = load_script(OWN_ADAPTER)
    out = tmp_path / "ahoy"
    answers = module.main(
        [str(out), "--steps", "2", "--serve", "--model-dir", str(smollm2_default_export)]
    )
    assert (out / "adapter_config.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()
    assert set(answers) == {smollm2_default_export.name, "ahoy"}
    assert all(isinstance(text, str) and text for text in answers.values())
