"""bench/bench_lora_nodes.py's copy of an export without LoraSGMV nodes: for requests without
adapters it must compute what the export computes (its timing is the benchmark's, never
checked here)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from script_module import load_script

from ort_lora import LLM, SamplingParams

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_lora_nodes.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


@pytest.mark.parametrize("export", ["tiny_llama_export", "tiny_quant_export"])
def test_the_copy_without_lora_nodes_gives_the_same_logprobs(bench, export, request, tmp_path):
    """Every LoraSGMV node gone, each of its outputs read from its y instead: the same greedy
    tokens and the same logprobs, bit for bit, as the export for prompts without adapters
    (on the float32 export, whose nodes read one module each, and the int4 one, whose q/k/v
    and gate/up nodes read several)."""
    model = request.getfixturevalue(export)
    model = model if isinstance(model, Path) else model("int4", 4)  # QuantMatMul, stacked
    copy = bench.strip_lora_nodes(model, tmp_path / "copy")
    graph = onnx.load(str(copy / "model.onnx"), load_external_data=False).graph
    assert {n.op_type for n in graph.node}.isdisjoint({"LoraSGMV"})
    assert not any(i.name.startswith("lora_") for i in graph.input)  # the LoRA tables' inputs
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 9, 2, 7]}, {"prompt_token_ids": [11, 3, 8]}]
    outs = [LLM(m, num_pages=64, seed=0).generate(prompts, params) for m in (model, copy)]
    for ours, theirs in zip(*outs):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
