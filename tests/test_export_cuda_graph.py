"""--device cuda exports (no GPU needed to inspect them): ORT's com.microsoft.PagedAttention,
half-precision weights, caches and rotary tables, float32 logits, ort_lora.LoraSGMV kept."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from safetensors.numpy import load_file

from ort_lora.contract import ModelManifest
from ort_lora.export import export_model
from ort_lora.export.exporter import default_block_size

ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
RTOL = {"float16": 1e-3, "bfloat16": 1e-2}  # half an ulp of each format, with margin


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_export_graph(tiny_llama_checkpoint, tmp_path, dtype):
    out = export_model(
        tiny_llama_checkpoint,
        tmp_path / "out",
        dtype=dtype,
        device="cuda",
        block_size=16,
        progress=False,
    )
    model = onnx.load(str(out / "model.onnx"))  # loads the external data too
    nodes = model.graph.node
    assert {n.domain for n in nodes if n.op_type == "PagedAttention"} == {"com.microsoft"}
    assert {n.domain for n in nodes if n.op_type == "LoraSGMV"} == {"ort_lora"}
    attention = next(n for n in nodes if n.op_type == "PagedAttention")
    assert list(attention.input)[10:] == ["slot_mapping", "", "", "", "", "", "attention_metadata"]
    assert len(attention.output) == 1  # K/V are written into key_cache / value_cache in place
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs["key_cache.0"] == ELEM[dtype] and inputs["value_cache.1"] == ELEM[dtype]
    assert inputs["lora_q_proj_scales"] == TensorProto.FLOAT
    assert inputs["attention_metadata"] == TensorProto.INT32
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    inits = {t.name: t for t in model.graph.initializer}
    assert inits["cos_cache"].data_type == ELEM[dtype]
    weights = load_file(str(tiny_llama_checkpoint / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    got = numpy_helper.to_array(inits[name]).astype(np.float32)  # [in, out]: transposed
    np.testing.assert_allclose(got, weights[name].T, rtol=RTOL[dtype], atol=1e-6)
    manifest = (out / "ort_lora_manifest.json").read_text()
    assert f'"dtype": "{dtype}"' in manifest and '"device": "cuda"' in manifest
    _assert_ort_resolves_graph(out)


def _assert_ort_resolves_graph(out):
    """ONNX Runtime (CPU build) resolves the graph: every node passes ORT's own schema and type
    inference (com.microsoft.PagedAttention's 17 inputs included) and session creation stops
    only at kernel lookup, since the CPU build has no half-precision PagedAttention / MatMul."""
    import onnxruntime as ort

    import ort_lora

    with pytest.raises(Exception, match="Could not find an implementation for") as err:
        ort.InferenceSession(
            str(out / "model.onnx"),
            sess_options=ort_lora.session_options(),
            providers=["CPUExecutionProvider"],
        )
    assert "NOT_IMPLEMENTED" in str(err.value)


@pytest.mark.parametrize(
    "device, head_dim, block",
    [
        ("cpu", 64, 16),
        ("cuda", 16, 256),
        ("cuda", 64, 256),
        ("cuda", 80, 128),
        ("cuda", 128, 128),
        ("cuda", 256, 64),
    ],
)
def test_default_block_size_is_what_orts_flash_paged_kernel_takes(device, head_dim, block):
    """ORT's CUDA PagedAttention runs FlashAttention's paged kernel only when block_size is a
    multiple of 256 (head_dim <= 64), 128 (<= 128) or 64; else prefill gathers the whole KV."""
    assert default_block_size(device, head_dim) == block


def test_cuda_export_without_block_size_takes_the_default(tiny_llama_checkpoint, tmp_path):
    out = export_model(
        tiny_llama_checkpoint, tmp_path / "out", dtype="float16", device="cuda", progress=False
    )
    assert ModelManifest.load(out).block_size == 256  # head_dim 16
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    cache = next(i for i in model.graph.input if i.name == "key_cache.0")
    assert cache.type.tensor_type.shape.dim[1].dim_value == 256
