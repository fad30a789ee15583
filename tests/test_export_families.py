"""Gemma 2 / 3, Phi-3 and Granite exports beyond the logits tests of test_export_models.py:
`ort-lora export --verify` per family, LongRoPE's per-position switch, configs as transformers
itself writes them (what a GGUF file yields), variants refused by name, the --device cuda graph.
"""

from __future__ import annotations

import re
from dataclasses import asdict

import numpy as np
import onnx
import pytest
import torch

from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.step_plan import base_plan
from ort_lora.export import ExportError, export_model
from ort_lora.export.arch import arch_config
from ort_lora.export.cli import main as export_main
from ort_lora.export.tiny import tiny_config, write_random_checkpoint
from ort_lora.export.verify import reference_step
from ort_lora.runtime import ModelSession

FAMILIES = ("gemma2", "gemma3", "phi3", "granite")


# Phi-3 with an original context of 32 (of 128): verify's prompts (11 to 30 tokens) are shorter,
# so transformers alone would rotate them with the short factors; verify gives it the long ones
# the export serves (verify.use_long_rope_factors)
VERIFIED = [(f, {}) for f in FAMILIES]
VERIFIED += [("phi3", {"original_max_position_embeddings": 32, "max_position_embeddings": 128})]


@pytest.mark.parametrize("family, overrides", VERIFIED)
def test_verify_passes(family, overrides, tmp_path, capsys):
    config = tiny_config(family, **overrides)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", config, seed=11)
    args = [str(ckpt), str(tmp_path / "out"), "--block-size", "8", "--verify", "--quiet"]
    rc = export_main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert float(re.search(r"max \|logits - transformers\| = (\S+)", text).group(1)) <= 1e-4


@pytest.mark.parametrize("context", [None, 16])
def test_longrope_factors_follow_the_served_context(context, tmp_path, rng):
    """Phi-3 with an original context of 16 (of 64): exported for 64 positions it runs on the
    long factors, exactly transformers on any sequence longer than 16 (here 24 tokens); with
    --extra max_position_embeddings=16 on the short ones, exactly transformers on any sequence
    that fits (10 tokens, then 6 greedy decode steps)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("phi3", original_max_position_embeddings=16)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", config, seed=12)
    extra = {} if context is None else {"max_position_embeddings": context}
    out = export_model(ckpt, tmp_path / "out", block_size=8, progress=False, extra=extra)
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    runner = ModelRunner(ModelSession(out, num_pages=4))
    prompt = rng.integers(3, 256, 24 if context is None else 10).tolist()
    n = len(prompt)
    ours = runner.run(base_plan((prompt, 0, [2, 0, 3], range(n)), block_size=8))  # [n, vocab]
    logits, cache = reference_step(ref, prompt)
    np.testing.assert_allclose(ours, logits, atol=1e-4, rtol=0)
    for past in range(n, 16 if context else n):
        token = int(logits[-1].argmax())
        logits, cache = reference_step(ref, [token], cache)
        ours = runner.run(base_plan(([token], past, [2, 0]), block_size=8))
        np.testing.assert_allclose(ours, logits[-1:], atol=1e-4, rtol=0)
    assert config["rope_scaling"]["short_factor"] != config["rope_scaling"]["long_factor"]


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gemma2", {}),
        ("gemma3", {}),
        ("gemma3", {"layer_types": None, "sliding_window_pattern": 2}),
        ("phi3", {}),
        ("phi3", {"sliding_window": 5, "rope_scaling": None, "partial_rotary_factor": 0.75}),
        ("granite", {}),
    ],
)
def test_config_as_transformers_writes_it(family, overrides):
    """A GGUF file reaches the exporter as transformers' config.to_dict() (no architectures,
    rope_parameters, Gemma 3's nested by layer type): it reads as the config.json does."""
    from transformers import AutoConfig

    config = tiny_config(family, **overrides)
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    written = AutoConfig.for_model(config["model_type"], **kwargs).to_dict()
    assert asdict(arch_config(written)) == asdict(arch_config(config))


REFUSED = [
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "vision tower"),
    ("phi3", {"architectures": ["Phi3SmallForCausalLM"]}, "Phi-3-small's block-sparse"),
    ("phi3", {"architectures": ["PhiMoEForCausalLM"]}, "Phi-3.5-MoE's mixture-of-experts"),
    ("granite", {"architectures": ["GraniteMoeHybridForCausalLM"]}, "Granite 4's hybrid"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "unsupported MLP activation 'gelu'"),
    ("llama", {"hidden_act": "relu"}, "unsupported MLP activation 'relu'"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ("gemma2", {"sliding_window": None}, "sliding_attention layers but no sliding_window"),
    ("phi3", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    (
        "phi3",
        {"rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4}},
        "short_factor has 3 entries; the rotary dimension 8 needs 4",
    ),
    ("gemma3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "type 'llama3'"),
]


@pytest.mark.parametrize("family, overrides, message", REFUSED)
def test_unsupported_variants_are_refused_by_name(family, overrides, message, tmp_path, capsys):
    with pytest.raises(ExportError, match=re.escape(message)):
        arch_config(tiny_config(family, **overrides))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(__import__("json").dumps(tiny_config(family, **overrides)))
    (ckpt / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    assert export_main([str(ckpt), str(tmp_path / "out"), "--quiet"]) == 1
    text = capsys.readouterr().err
    assert message in text and "Traceback" not in text


PHI3_CUDA = {  # head_dim 32: a rotary dimension of 16, what ORT's CUDA kernels take
    "head_dim": 32,
    "rope_scaling": {"type": "su", "short_factor": [1.5] * 8, "long_factor": [3.0] * 8},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graph_carries_each_layers_attention(family, tmp_path):
    """--device cuda: every layer's com.microsoft.PagedAttention has that layer's scale,
    softcap and window, rotary tables have rotary_dim / 2 columns in float16 (a second pair
    for Gemma 3's sliding layers), GeGLU is ORT's FastGelu, and ORT resolves the graph."""
    from test_export_cuda_graph import _assert_ort_resolves_graph

    config = tiny_config(family, **(PHI3_CUDA if family == "phi3" else {}))
    cfg = arch_config(config)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", config, seed=13)
    out = export_model(ckpt, tmp_path / "out", dtype="float16", device="cuda", progress=False)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    attention = [n for n in graph.node if n.op_type == "PagedAttention"]
    assert [n.domain for n in attention] == ["com.microsoft"] * cfg.num_layers
    for layer, node in enumerate(attention):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        window = cfg.window(layer)
        assert attrs["local_window_size"] == (-1 if window is None else window - 1)
        assert attrs["softcap"] == pytest.approx(cfg.attn_softcap or 0.0)
        assert attrs["scale"] == pytest.approx(cfg.attention_scale or cfg.head_dim**-0.5)
        local = cfg.local_rope_theta is not None and window is not None
        assert node.input[8] == ("cos_cache_local" if local else "cos_cache")
    inits = {t.name: t for t in graph.initializer}
    assert list(inits["cos_cache"].dims) == [cfg.max_position_embeddings, cfg.rotary_dim // 2]
    assert inits["cos_cache"].data_type == onnx.TensorProto.FLOAT16
    gelu = [n.domain for n in graph.node if n.op_type == "FastGelu"]
    assert gelu == (["com.microsoft"] * cfg.num_layers if family.startswith("gemma") else [])
    _assert_ort_resolves_graph(out)


def test_cuda_refuses_a_rotary_dimension_its_kernels_do_not_take(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config("phi3"), seed=14)  # rotary 8
    with pytest.raises(ExportError, match="rotary dimension 8: ORT's CUDA PagedAttention"):
        export_model(ckpt, tmp_path / "out", dtype="float16", device="cuda", progress=False)
