"""The base graph (ort_lora/runtime/base_graph.py): the export without LoraSGMV nodes, which
runs the steps in which no row has an adapter. Its logits must be the export's bit for bit,
whatever the other requests of the engine use, and it must hold no copy of the weights."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora import contract as C
from ort_lora.runtime.base_graph import reads_weights_in_place, without_lora_nodes
from ort_lora.runtime.session import ModelSession


def _int4(tiny_quant_export) -> Path:
    return tiny_quant_export("int4", 4)  # QuantMatMul, stacked q/k/v and gate/up nodes


def _graph(model_dir: Path):
    return onnx.load(str(model_dir / C.MODEL_NAME), load_external_data=False)


def test_the_base_graph_reads_each_node_y_where_its_output_was_read(tiny_quant_export):
    """No LoraSGMV node and none of the LoRA tables' inputs are left; every other node is."""
    model = _graph(_int4(tiny_quant_export))
    others = [n.op_type for n in model.graph.node if n.op_type != "LoraSGMV"]
    base = without_lora_nodes(model).graph
    assert [n.op_type for n in base.node] == others
    assert not any(i.name.startswith("lora_") for i in base.input)
    produced = {o for n in base.node for o in n.output} | {i.name for i in base.input}
    produced |= {t.name for t in base.initializer}
    assert all(name in produced for n in base.node for name in n.input if name)
    assert all(o.name in produced for o in base.output)


def test_only_exports_read_in_place_get_a_base_graph_by_default(
    tiny_llama_export, tiny_quant_export
):
    """The float32 export's MatMul weights would be prepacked again by a second session: no
    base graph unless asked for; the int4 export's QuantMatMul weights are read in place."""
    assert not reads_weights_in_place(_graph(tiny_llama_export))
    assert reads_weights_in_place(_graph(_int4(tiny_quant_export)))
    loaded = {
        (name, flag): ModelSession(model, 16, base_graph=flag).base is not None
        for name, model in (("float32", tiny_llama_export), ("int4", _int4(tiny_quant_export)))
        for flag in (None, True, False)
    }
    assert loaded == {
        ("float32", None): False, ("float32", True): True, ("float32", False): False,
        ("int4", None): True, ("int4", True): True, ("int4", False): False,
    }  # fmt: skip


def test_a_base_graph_that_cannot_load_is_left_out_unless_asked_for(
    tiny_quant_export, monkeypatch, caplog
):
    """ONNX Runtime refusing the base graph (as one without the external-data folder option
    would) leaves the default engine on the export's graph, said in the log; asked for
    explicitly, the error is raised."""
    import onnxruntime

    made = onnxruntime.InferenceSession

    def refusing(model, *args, **kwargs):
        if isinstance(model, bytes):
            raise RuntimeError("injected: external data not found")
        return made(model, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", refusing)
    model = _int4(tiny_quant_export)
    with caplog.at_level("WARNING", logger="ort_lora"):
        session = ModelSession(model, 16, base_graph=None)
    assert session.base is None and "injected: external data not found" in caplog.text
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(LLM(model, num_pages=16).generate([[5, 9, 2]], params)[0].outputs[0].token_ids) == 3
    with pytest.raises(RuntimeError, match="injected"):
        ModelSession(model, 16, base_graph=True)


@pytest.mark.parametrize("export", ["tiny_llama_export", "int4"])
def test_the_base_graph_gives_the_export_logprobs(export, request, tiny_qv_adapter):
    """The same requests on an engine without a base graph and on one with: the same tokens
    and logprobs bit for bit, for base requests alone and beside an adapter's (whose steps run
    the export's graph until it finishes, the base request's later steps the base graph)."""
    if export == "int4":
        model = _int4(request.getfixturevalue("tiny_quant_export"))
    else:
        model = request.getfixturevalue(export)
    lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
    prompts = [{"prompt_token_ids": [5, 9, 2, 7]}, {"prompt_token_ids": [11, 3, 8]}]
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
    long = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs, runs = {}, {}
    for flag in (False, True):
        llm = LLM(model, num_pages=64, seed=0, base_graph=flag)
        session = llm.engine.runner.session
        runs[flag] = counted = {"export": 0, "base": 0}
        for name, graph in (("export", session.graph), ("base", session.base)):
            if graph is not None:
                graph.run = _counting(graph.run, counted, name)
        alone = llm.generate(prompts, long)
        mixed = llm.generate(prompts, [long, short], lora_request=[None, lora])
        outputs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone + mixed]
    assert outputs[False] == outputs[True]
    assert runs[False]["base"] == 0 and runs[True]["base"] > 0  # the base graph ran steps
    assert runs[True]["export"] > 0  # the adapter's steps ran on the export's graph
    assert runs[False]["export"] == runs[True]["export"] + runs[True]["base"]


def _counting(run, counted: dict, name: str):
    def counted_run(inputs):
        counted[name] += 1
        return run(inputs)

    return counted_run
