"""The README's own-session example runs and agrees with the engine's greedy decoding."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ort_lora import LLM, SamplingParams

EXAMPLE = Path(__file__).parent.parent / "examples" / "own_session.py"


def test_own_session_example_matches_engine(tiny_llama_export):
    spec = importlib.util.spec_from_file_location("own_session", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = [1, 5, 17, 99, 3, 42, 8, 77, 120, 64]  # spans two blocks of 8
    tokens = module.main(
        [str(tiny_llama_export), "--tokens", "12", "--prompt-ids", ",".join(map(str, prompt))]
    )
    llm = LLM(tiny_llama_export, num_pages=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert tokens == prompt + out.outputs[0].token_ids
