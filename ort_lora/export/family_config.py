"""What a family's config says beyond the keys every decoder shares, as ArchConfig fields.

One reader per family (FAMILY_READERS), plus the rope parameters, which families spell
differently. A key missing from config.json takes transformers' default for that family (its
config class's default), since that is what transformers runs.
"""

from __future__ import annotations

import math

from ort_lora.export.errors import ExportError

DEFAULT_ROPE_SCALINGS = ("linear", "llama3")
ROPE_SCALINGS = {"phi3": ("longrope",), "gemma3": ("linear",)}  # where not the default
PHI3_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def int_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# ---- rope ----------------------------------------------------------------------------------
def read_rope(config: dict, family: str) -> tuple[float, dict | None]:
    """(theta, scaling) of the (global) rotary embedding: the classic rope_theta / rope_scaling
    keys or transformers>=5 rope_parameters (nested by layer type for Gemma 3)."""
    params = config.get("rope_parameters") or {}
    if family == "gemma3":
        if "full_attention" in params:
            params = params["full_attention"] or {}
        else:
            params = dict(config.get("rope_scaling") or {}, rope_theta=config.get("rope_theta"))
        return _theta_and_scaling(params, 1_000_000.0, family, config)
    params = dict(config.get("rope_scaling") or params)
    params["rope_theta"] = config.get("rope_theta") or params.get("rope_theta")
    return _theta_and_scaling(params, 10000.0, family, config)


def _theta_and_scaling(params: dict, default_theta: float, family: str, config: dict):
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    theta = float(params.get("rope_theta") or default_theta)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if family == "phi3" and rope_type in ("su", "yarn"):  # transformers' Phi3Config renames
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None
    allowed = ROPE_SCALINGS.get(family, DEFAULT_ROPE_SCALINGS)
    if rope_type not in allowed:
        raise ExportError(
            f"unsupported rope scaling type {rope_type!r}; supported: default, {', '.join(allowed)}"
        )
    scaling["rope_type"] = rope_type
    return theta, _longrope(scaling, config) if rope_type == "longrope" else scaling


def _longrope(scaling: dict, config: dict) -> dict:
    """LongRoPE (Phi-3 "su"): per-frequency factors, short below the original context length,
    long from it, and one attention factor on cos and sin (transformers'
    _compute_longrope_parameters; Phi3Config's top-level original_max_position_embeddings wins)."""
    original = int(config.get("original_max_position_embeddings") or 4096)
    factor = scaling.get("factor") or int(config["max_position_embeddings"]) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in scaling["short_factor"]],
        "long_factor": [float(f) for f in scaling["long_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention),
    }


# ---- families -------------------------------------------------------------------------------
def _mistral(config: dict, common: dict) -> dict:
    window = config.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


def _qwen2(config: dict, common: dict) -> dict:
    return {"attention_bias": True}


def _qwen3(config: dict, common: dict) -> dict:
    return {"qk_norm": True}


def _gemma_layer_types(config: dict, num_layers: int, pattern: int) -> list[str]:
    """Gemma 2 alternates sliding / full (pattern 2); Gemma 3 has one full layer in 6."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = int(config.get("sliding_window_pattern") or pattern)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def _gemma(config: dict, common: dict, pattern: int, softcaps: tuple) -> dict:
    """Gemma 2 and 3: sqrt(hidden)-scaled embeddings, GeGLU, query_pre_attn_scalar, sliding and
    global layers, final logit soft-capping (transformers' defaults: Gemma2Config's)."""
    window = config.get("sliding_window", 4096)
    final = config.get("final_logit_softcapping", softcaps[1])
    return {
        "activation": config.get("hidden_activation") or "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": _gemma_layer_types(config, common["num_layers"], pattern),
        "attention_scale": float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_softcap": float(final) if final else None,
        "embedding_multiplier": common["hidden_size"] ** 0.5,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


def _gemma2(config: dict, common: dict) -> dict:
    cap = config.get("attn_logit_softcapping", 50.0)
    return _gemma(config, common, 2, (50.0, 30.0)) | {"attn_softcap": float(cap) if cap else None}


def _gemma3(config: dict, common: dict) -> dict:
    """Gemma 3 text: Gemma 2 plus q/k norms and a local rope base for sliding layers; its
    attention takes no soft-capping (transformers' Gemma3Attention ignores the key)."""
    if config.get("use_bidirectional_attention"):
        raise ExportError(
            "use_bidirectional_attention (EmbeddingGemma-style encoder attention) is not "
            "supported; only causal Gemma 3 decoders are"
        )
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        local = {"rope_theta": config.get("rope_local_base_freq")}
    local_theta, local_scaling = _theta_and_scaling(local, 10000.0, "gemma3", config)
    if local_scaling is not None:
        raise ExportError("rope scaling of Gemma 3's sliding layers is not supported")
    return _gemma(config, common, 6, (None, None)) | {
        "qk_norm": True,
        "local_rope_theta": local_theta,
    }


def _phi3(config: dict, common: dict) -> dict:
    """Phi-3 / Phi-3.5 / Phi-4(-mini): fused qkv_proj and gate_up_proj, partial rotary,
    LongRoPE (read by read_rope), a sliding window on every layer when the config has one."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    window = config.get("sliding_window")
    return {
        "rotary_dim": int(common["head_dim"] * float(partial)),
        "sliding_window": int(window) if window else None,
        "fused_modules": {k: list(v) for k, v in PHI3_FUSED.items()},
    }


def _granite(config: dict, common: dict) -> dict:
    """Granite 3.x: embedding, residual, attention and logits multipliers."""
    return {
        "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "attention_scale": float(config.get("attention_multiplier", 1.0)),
        "logits_scaling": float(config.get("logits_scaling", 1.0)),
    }


FAMILY_READERS = {
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "granite": _granite,
}
