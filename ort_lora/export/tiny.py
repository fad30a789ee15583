"""Random checkpoints for tests and benchmarks, written tensor by tensor (no model object).

`tiny_config(family)` is a small config of each supported family; `write_random_checkpoint`
writes config.json + safetensors (optionally sharded, with the index json) for any config,
e.g. a Llama-3.2-1B-shaped one for the export benchmark; `save_random_adapters` saves PEFT
adapters of a model whose every part changes its output.
"""

from __future__ import annotations

import json
from pathlib import Path

from ort_lora.export.arch import SUPPORTED_ARCHITECTURES, ArchConfig, arch_config
from ort_lora.export.tiny_tokenizer import write_byte_tokenizer

TINY_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


# What each family's tiny config adds to TINY_BASE: every feature the family's builder has,
# at sizes a short test sequence reaches (windows of a few tokens; a LongRoPE original context
# of 4 tokens, so that every test sequence runs on the long factors, as the export does).
TINY_FAMILY = {
    "mistral": dict(sliding_window=5),
    "qwen2": dict(use_sliding_window=False),
    "gemma2": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        original_max_position_embeddings=4,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.3, 2.1, 3.5],
            "long_factor": [1.1, 2.5, 5.0, 9.0],
        },
        pad_token_id=0,
    ),
    "granite": dict(
        embedding_multiplier=6.0,
        residual_multiplier=0.3,
        attention_multiplier=0.2,
        logits_scaling=4.0,
        tie_word_embeddings=True,
    ),
}


def tiny_config(family: str, **overrides) -> dict:
    """A config.json dict of a tiny model of `family` (a key of families.BUILDERS).

    Tiny models keep block_size * kv_heads * head_dim >= max(hidden, intermediate) for
    block_size 8 (2 * 16 * 8 = 256 >= 128), so a LoRA row fits in a page half.
    """
    arch = next(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == family)
    config = dict(TINY_BASE, model_type=family, architectures=[arch])
    config.update(TINY_FAMILY.get(family, {}))
    config.update(overrides)
    return config


def _tensor_shapes(cfg: ArchConfig, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        shapes.update(_linear_shapes(cfg, p, qkv_bias))
        shapes[f"{p}.input_layernorm.weight"] = (cfg.hidden_size,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (cfg.hidden_size,)
        if cfg.family in ("gemma2", "gemma3"):
            shapes[f"{p}.pre_feedforward_layernorm.weight"] = (cfg.hidden_size,)
            shapes[f"{p}.post_feedforward_layernorm.weight"] = (cfg.hidden_size,)
        if cfg.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (cfg.head_dim,)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def _linear_shapes(cfg: ArchConfig, p: str, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    """Weights (and q/k/v biases) of one layer's linear modules; a fused checkpoint module
    (Phi-3's qkv_proj, gate_up_proj) stacks its parts' rows."""
    sizes, shapes = cfg.module_sizes(), {}
    fused_parts = {part for parts in cfg.fused_modules.values() for part in parts}
    modules = [m for m in sizes if m not in fused_parts]
    out = {m: sizes[m]["out"] for m in modules}
    out |= {f: sum(sizes[part]["out"] for part in ps) for f, ps in cfg.fused_modules.items()}
    inputs = {m: sizes[m]["in"] for m in modules}
    inputs |= {f: sizes[ps[0]]["in"] for f, ps in cfg.fused_modules.items()}
    for module in out:
        kind = (
            "mlp"
            if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
            else "self_attn"
        )
        shapes[f"{p}.{kind}.{module}.weight"] = (out[module], inputs[module])
        if qkv_bias and module in ("q_proj", "k_proj", "v_proj"):
            shapes[f"{p}.{kind}.{module}.bias"] = (out[module],)
    return shapes


def _random(name: str, shape: tuple[int, ...], gen, norm_offset: float):
    import torch

    if name.endswith("norm.weight"):
        return norm_offset + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def write_random_checkpoint(
    out_dir, config: dict, *, seed: int = 0, dtype: str = "float32", shards: int = 1
) -> Path:
    """Write config.json and random safetensors weights for `config`; returns out_dir."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = arch_config(config)
    shapes = _tensor_shapes(cfg, qkv_bias=cfg.family == "qwen2")
    norm_offset = 0.0 if cfg.family in ("gemma2", "gemma3") else 1.0  # Gemma norms: 1 + w
    gen = torch.Generator().manual_seed(seed)
    names = list(shapes)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        file = "model.safetensors" if shards == 1 else file
        chunk = names[i * per_shard : (i + 1) * per_shard]
        tensors = {
            n: _random(n, shapes[n], gen, norm_offset).to(getattr(torch, dtype)) for n in chunk
        }
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
        del tensors
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_byte_tokenizer(out, cfg.vocab_size)
    return out


def save_random_adapters(hf_model, root, configs: dict, seed: int) -> dict[str, Path]:
    """name -> directory of a PEFT adapter per config (peft.LoraConfig kwargs) on a copy of
    hf_model, seeded seed + its index: PEFT's random A, B ~ N(0, 0.5) (PEFT starts B at zero)
    and (DoRA) magnitudes moved off their initial norms by up to ~30 %, so that the LoRA delta
    and the DoRA scale both change the output."""
    import copy

    import peft
    import torch

    dirs = {}
    for i, (name, kwargs) in enumerate(configs.items()):
        torch.manual_seed(seed + i)
        config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        model = peft.get_peft_model(copy.deepcopy(hf_model), config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.5)
                if "lora_magnitude_vector" in n:
                    p.mul_(1 + 0.3 * torch.randn_like(p))
        model.save_pretrained(Path(root) / name)
        dirs[name] = Path(root) / name
    return dirs
