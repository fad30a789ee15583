"""Architecture families the exporter supports, and a normalized view of a model config.

A checkpoint's config.json (or the config transformers derives from a GGUF file) is reduced to
`ArchConfig`: the few numbers the graph builder needs, named once, validated once. What only
one family has (Gemma's soft-capping, Phi-3's fused modules, Granite's multipliers) is read by
that family's reader in family_config.py; a field a model does not use keeps its neutral value,
and the builder emits no node for a neutral value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ort_lora.export.errors import ExportError
from ort_lora.export.family_config import FAMILY_READERS, int_list, read_rope

# architectures entry of config.json -> family (builder)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
}
# model_type -> architecture, for configs without `architectures` (those of GGUF files)
MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
}
# Variants of the supported families (or close relatives) that are refused by name: exporting
# them with a supported family's builder would produce a wrong graph.
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (gemma-3-4b and larger) "
    "is not supported; the text-only Gemma3ForCausalLM checkpoints (gemma-3-270m, gemma-3-1b) are",
    "Phi3SmallForCausalLM": "Phi-3-small's block-sparse attention is not supported",
    "Phi3VForCausalLM": "Phi-3-vision's image encoder is not supported",
    "Phi4MMForCausalLM": "Phi-4-multimodal's audio and vision encoders are not supported",
    "PhiMoEForCausalLM": "Phi-3.5-MoE's mixture-of-experts layers are not supported",
    "GraniteMoeForCausalLM": "Granite mixture-of-experts layers are not supported",
    "GraniteMoeSharedForCausalLM": "Granite mixture-of-experts layers are not supported",
    "GraniteMoeHybridForCausalLM": "Granite 4's hybrid Mamba / mixture-of-experts layers are "
    "not supported",
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # MLP activations the builder emits
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ArchConfig:
    """What the graph builder needs from a checkpoint's config."""

    architecture: str
    family: str  # a key of families.BUILDERS
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
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    sliding_window: int | None  # HF convention: W keys visible, including the token itself
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    activation: str = "silu"  # one of ACTIVATIONS
    # per layer: "full_attention" | "sliding_attention" (the latter sees sliding_window keys);
    # empty: every layer sliding if sliding_window is set, else full
    layer_types: list[str] = field(default_factory=list)
    rotary_dim: int = 0  # channels of a head that rotary rotates (partial rotary); 0 = head_dim
    local_rope_theta: float | None = None  # rope base of sliding layers (Gemma 3); None = same
    attention_scale: float | None = None  # softmax scale of q.k; None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2 / 3)
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden), Granite)
    residual_multiplier: float = 1.0  # each layer's branch output times this (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    # checkpoint module -> the target modules its output rows are split into, in order
    # (Phi-3: qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj)
    fused_modules: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ExportError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        self.rotary_dim = self.rotary_dim or self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ExportError(
                f"rotary dimension {self.rotary_dim} (head_dim x partial_rotary_factor) must be "
                f"even and in [2, head_dim={self.head_dim}]"
            )
        if self.activation not in ACTIVATIONS:
            raise ExportError(
                f"unsupported MLP activation {self.activation!r} of {self.architecture}; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        self._check_layer_types()
        self._check_longrope()

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_layers
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.num_layers:
            raise ExportError(
                f"layer_types must list {self.num_layers} entries of {', '.join(LAYER_TYPES)}; "
                f"got {len(self.layer_types)} entries (unsupported: {unknown or 'none'})"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ExportError("layer_types has sliding_attention layers but no sliding_window")

    def _check_longrope(self) -> None:
        if not self.rope_scaling or self.rope_scaling["rope_type"] != "longrope":
            return
        for key in ("short_factor", "long_factor"):
            if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                raise ExportError(
                    f"rope scaling {key} has {len(self.rope_scaling[key])} entries; the rotary "
                    f"dimension {self.rotary_dim} needs {self.rotary_dim // 2}"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Keys a token of `layer` sees, itself included (HF's sliding_window); None = all."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

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
    """(architecture, family) of a config dict, or an ExportError naming why not."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch, SUPPORTED_ARCHITECTURES[arch]
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            raise ExportError(f"unsupported architecture {arch}: {REFUSED_ARCHITECTURES[arch]}")
    model_type = config.get("model_type")
    if not archs and model_type in MODEL_TYPE_TO_ARCH:
        arch = MODEL_TYPE_TO_ARCH[model_type]
        return arch, SUPPORTED_ARCHITECTURES[arch]
    found = ", ".join(archs) or f"model_type={model_type!r}"
    raise ExportError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def arch_config(config: dict, generation_config: dict | None = None) -> ArchConfig:
    """Normalize a config dict (config.json keys) into an ArchConfig."""
    arch, family = resolve_architecture(config)
    gen = generation_config or {}
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        theta, scaling = read_rope(config, family)
        eos = int_list(gen.get("eos_token_id")) or int_list(config.get("eos_token_id"))
        common = dict(
            architecture=arch,
            family=family,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=False,
            sliding_window=None,
            eos_token_ids=eos,
            bos_token_id=gen.get("bos_token_id", config.get("bos_token_id")),
            activation=config.get("hidden_act") or "silu",
        )
        if family in FAMILY_READERS:
            common.update(FAMILY_READERS[family](config, common))
        return ArchConfig(**common)
    except KeyError as e:
        raise ExportError(f"config of {arch} lacks the required key {e.args[0]!r}") from None
