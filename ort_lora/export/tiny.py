"""Random checkpoints for tests and benchmarks, written tensor by tensor (no model object).

`tiny_config(family)` is a small config of each supported family; `write_random_checkpoint`
writes config.json + safetensors (optionally sharded, with the index json) for any config,
e.g. a Llama-3.2-1B-shaped one for the export benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

from ort_lora.export.arch import MODEL_TYPE_TO_ARCH, ArchConfig, arch_config
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


def tiny_config(family: str, **overrides) -> dict:
    """A config.json dict of a tiny model of `family` (llama, mistral, qwen2, qwen3).

    Tiny models keep block_size * kv_heads * head_dim >= max(hidden, intermediate) for
    block_size 8 (2 * 16 * 8 = 256 >= 128), so a LoRA row fits in a page half.
    """
    config = dict(TINY_BASE, model_type=family, architectures=[MODEL_TYPE_TO_ARCH[family]])
    if family == "mistral":
        config["sliding_window"] = 5
    if family == "qwen2":
        config["use_sliding_window"] = False
    config.update(overrides)
    return config


def _tensor_shapes(cfg: ArchConfig, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        for module, size in cfg.module_sizes().items():
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            shapes[f"{p}.{kind}.{module}.weight"] = (size["out"], size["in"])
            if qkv_bias and module in ("q_proj", "k_proj", "v_proj"):
                shapes[f"{p}.{kind}.{module}.bias"] = (size["out"],)
        shapes[f"{p}.input_layernorm.weight"] = (cfg.hidden_size,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (cfg.hidden_size,)
        if cfg.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (cfg.head_dim,)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def _random(name: str, shape: tuple[int, ...], gen):
    import torch

    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
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
    gen = torch.Generator().manual_seed(seed)
    names = list(shapes)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        file = "model.safetensors" if shards == 1 else file
        chunk = names[i * per_shard : (i + 1) * per_shard]
        tensors = {n: _random(n, shapes[n], gen).to(getattr(torch, dtype)) for n in chunk}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
        del tensors
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_byte_tokenizer(out, cfg.vocab_size)
    return out
