"""One small builder per architecture family; the shared graph lives in decoder.py."""

from __future__ import annotations

from ort_lora.export.decoder import DecoderBuilder


class LlamaBuilder(DecoderBuilder):
    """Llama 1/2/3, SmolLM, TinyLlama: the shared decoder as is (rope scaling in rope.py)."""


class MistralBuilder(DecoderBuilder):
    """Mistral: sliding-window attention."""

    def attention_window(self) -> int:
        # HF's sliding_window W means W visible keys including the token itself; the op's
        # local_window_size w means keys j >= p - w are visible (w + 1 keys).
        window = self.cfg.sliding_window
        return -1 if window is None else window - 1


class Qwen2Builder(DecoderBuilder):
    """Qwen2: q/k/v biases (added by `linear` whenever the checkpoint has them)."""


class Qwen3Builder(DecoderBuilder):
    """Qwen3: per-head RMSNorm on q and k after their projections, before rotary."""

    def qk_norm(self, layer: int, q: str, k: str) -> tuple[str, str]:
        return self._head_norm(layer, q, "q_norm"), self._head_norm(layer, k, "k_norm")

    def _head_norm(self, layer: int, x: str, which: str) -> str:
        g, hd = self.g, self.cfg.head_dim
        name = f"/model/layers.{layer}/self_attn/{which}"
        heads = g.constant_i64(f"{name}/heads_shape", [-1, hd])
        (per_head,) = g.node("Reshape", [x, heads], f"{name}/Reshape")  # [T * heads, hd]
        normed = self.rms_norm(
            per_head,
            f"model.layers.{layer}.self_attn.{which}.weight",
            f"{name}/SimplifiedLayerNormalization",
            hd,
        )
        (shape,) = g.node("Shape", [x], f"{name}/Shape")  # [2]: T, heads * hd
        (y,) = g.node("Reshape", [normed, shape], f"{name}/Reshape_back")  # [T, heads * hd]
        return y


BUILDERS = {
    "llama": LlamaBuilder,
    "mistral": MistralBuilder,
    "qwen2": Qwen2Builder,
    "qwen3": Qwen3Builder,
}
