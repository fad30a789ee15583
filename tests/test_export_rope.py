"""Rotary caches vs transformers' rotary embedding (default, linear, llama3 scaling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ort_lora.export.arch import arch_config
from ort_lora.export.rope import cos_sin_cache
from ort_lora.export.tiny import tiny_config

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_cos_sin_cache_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config(
        "llama",
        head_dim=64,
        num_attention_heads=2,
        hidden_size=128,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rope_scaling=SCALINGS[kind],
    )
    cfg = arch_config(config)
    cos, sin = cos_sin_cache(2048, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [P, 32]
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.randint(0, 2048, (1, 64))
    hf_cos, hf_sin = rotary(torch.zeros(1, 64, 1), positions)  # [1, 64, head_dim]
    idx = positions[0].numpy()
    # HF computes angles in float32; positions up to 2048 leave ~1e-4 of rounding.
    np.testing.assert_allclose(cos[idx], hf_cos[0, :, :32].numpy(), atol=5e-4)
    np.testing.assert_allclose(sin[idx], hf_sin[0, :, :32].numpy(), atol=5e-4)
