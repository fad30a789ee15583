"""PEFT adapters on fused modules (Phi-3's qkv_proj, gate_up_proj) in their host form: the
parts' deltas, side by side, are PEFT's delta of the fused module for every layer (scaling
from the fused module's rank / alpha patterns), and adapters the export cannot serve are
refused by name. End to end against PEFT: test_engine_families.py."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from ort_lora.adapters import AdapterError
from ort_lora.adapters.host import load_adapter

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from test_adapters import HIDDEN, INTER, KV_HEADS, LAYERS, manifest  # noqa: E402

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
LORA = dict(
    r=8,
    lora_alpha=16,
    target_modules=["qkv_proj", "gate_up_proj", "down_proj"],
    rank_pattern={"gate_up_proj": 4},
    alpha_pattern={"model.layers.1.self_attn.qkv_proj": 40},
)


def phi3_manifest(targets=None):
    base = manifest() if targets is None else manifest(targets=targets)
    return dataclasses.replace(base, architecture="Phi3ForCausalLM", fused_modules=FUSED)


@pytest.fixture(scope="module")
def fused_adapter(tmp_path_factory):
    """(PEFT model, adapter dir) of a random adapter on a tiny Phi-3's fused modules."""
    torch.manual_seed(5)
    config = transformers.Phi3Config(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=100, pad_token_id=0,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.Phi3ForCausalLM(config), peft.LoraConfig(init_lora_weights=False, **LORA)
    )
    path = tmp_path_factory.mktemp("fused") / "adapter"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("layer", range(LAYERS))
@pytest.mark.parametrize("fused, block", [("qkv_proj", "self_attn"), ("gate_up_proj", "mlp")])
def test_parts_side_by_side_are_the_fused_delta(fused_adapter, fused, block, layer, rng):
    model, path = fused_adapter
    host = load_adapter("fused", path, phi3_manifest())
    x = rng.standard_normal((5, HIDDEN)).astype(np.float32)
    parts = []
    for part in FUSED[fused]:
        w = host.modules[part]
        parts.append(w.scales[layer] * (x @ w.layer_a(layer).T) @ w.layer_bt(layer))
    lin = getattr(getattr(model.base_model.model.model.layers[layer], block), fused)
    with torch.no_grad():
        want = (lin(torch.from_numpy(x)) - lin.base_layer(torch.from_numpy(x))).numpy()
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-5, rtol=0)


def test_refused_where_the_export_has_no_such_fused_module(fused_adapter):
    with pytest.raises(
        AdapterError, match=r"targets module '(qkv|gate_up)_proj'; supported LoRA modules"
    ):
        load_adapter("fused", fused_adapter[1], manifest())  # a Llama export


def test_refused_where_the_export_lacks_a_part(fused_adapter):
    targets = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    with pytest.raises(AdapterError, match=r"targets 'k_proj', which the exported model does"):
        load_adapter("fused", fused_adapter[1], phi3_manifest(targets))


def test_refused_when_a_part_is_also_targeted_alone(fused_adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(fused_adapter[1], tmp_path / "both")
    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"].append("q_proj")
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(8, HIDDEN)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(64, 8)
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"both put LoRA on q_proj of layer 0"):
        load_adapter("both", path, phi3_manifest())
