"""Architecture families the exporter supports, and a normalized view of a model config.

A checkpoint's config.json (or the config transformers derives from a GGUF file) is reduced to
`ArchConfig`: the few numbers the graph builder needs, named once, validated once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ort_lora.export.errors import ExportError

# architectures entry of config.json -> family (builder); model_type as a fallback.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPE_TO_ARCH = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}


@dataclass
class ArchConfig:
    """What the graph builder needs from a checkpoint's config."""

    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalized: {"rope_type": ..., "factor": ..., ...} or None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None  # HF convention: W keys visible, including the token itself
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_sizes(self) -> dict[str, dict[str, int]]:
        """in/out features of each of the seven linear modules of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": {"in": h, "out": self.q_size},
            "k_proj": {"in": h, "out": self.kv_size},
            "v_proj": {"in": h, "out": self.kv_size},
            "o_proj": {"in": self.q_size, "out": h},
            "gate_proj": {"in": h, "out": i},
            "up_proj": {"in": h, "out": i},
            "down_proj": {"in": i, "out": h},
        }


def resolve_architecture(config: dict) -> tuple[str, str]:
    """(architecture, family) of a config dict, or an ExportError listing the supported ones."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch, SUPPORTED_ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[model_type], model_type
    found = ", ".join(archs) or f"model_type={model_type!r}"
    raise ExportError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the classic rope_theta/rope_scaling keys or the
    transformers>=5 rope_parameters dict."""
    params = config.get("rope_parameters") or {}
    scaling = dict(config.get("rope_scaling") or params or {})
    theta = float(config.get("rope_theta") or scaling.pop("rope_theta", None) or 10000.0)
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ExportError(
            f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
        )
    scaling["rope_type"] = rope_type
    return theta, scaling


def _int_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def arch_config(config: dict, generation_config: dict | None = None) -> ArchConfig:
    """Normalize a config dict (config.json keys) into an ArchConfig."""
    arch, family = resolve_architecture(config)
    cfg = _arch_config(config, generation_config or {}, arch, family)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ExportError(
            f"num_attention_heads {cfg.num_heads} is not a multiple of "
            f"num_key_value_heads {cfg.num_kv_heads}"
        )
    return cfg


def _arch_config(config: dict, gen: dict, arch: str, family: str) -> ArchConfig:
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        theta, scaling = _rope(config)
        eos = _int_list(gen.get("eos_token_id")) or _int_list(config.get("eos_token_id"))
        window = config.get("sliding_window") if family == "mistral" else None
        return ArchConfig(
            architecture=arch,
            family=family,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            eos_token_ids=eos,
            bos_token_id=gen.get("bos_token_id", config.get("bos_token_id")),
        )
    except KeyError as e:
        raise ExportError(f"config of {arch} lacks the required key {e.args[0]!r}") from None
