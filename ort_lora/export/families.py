"""One small builder per architecture family; the shared graph lives in decoder.py.

A family's numbers (windows, soft-capping, multipliers, partial rotary, rope scaling) are read
into ArchConfig by family_config.py and need no code here; a class overrides a decoder hook
only where the graph's structure differs. docs/ADDING_A_FAMILY.md walks through adding one.
"""

from __future__ import annotations

from ort_lora.export.decoder import DecoderBuilder
from ort_lora.export.errors import ExportError


class LlamaBuilder(DecoderBuilder):
    """Llama 1/2/3, SmolLM, TinyLlama: the shared decoder as is (rope scaling in rope.py)."""


class MistralBuilder(DecoderBuilder):
    """Mistral: sliding-window attention on every layer (ArchConfig.sliding_window)."""


class Qwen2Builder(DecoderBuilder):
    """Qwen2: q/k/v biases (added by `linear` whenever the checkpoint has them)."""


class Qwen3Builder(DecoderBuilder):
    """Qwen3: per-head RMSNorm on q and k after their projections, before rotary."""

    def qk_norm(self, layer: int, q: str, k: str) -> tuple[str, str]:
        return self.head_norms(layer, q, k)


class GraniteBuilder(DecoderBuilder):
    """Granite 3.x: the Llama graph with the embedding, residual, attention and logits
    multipliers of its config (ArchConfig: embedding_multiplier, residual_multiplier,
    attention_scale, logits_scaling)."""


class Gemma2Builder(DecoderBuilder):
    """Gemma 2: RMSNorm weights are offsets from 1, a norm after attention and after the MLP
    (before each joins the residual stream) and one before the MLP. Embedding scaling, GeGLU,
    query_pre_attn_scalar, soft-capping and alternating sliding / global layers are config."""

    pre_mlp_norm = "pre_feedforward_layernorm"

    def norm_weight(self, name: str, size: int) -> str:
        return self.initializer_from(name, 1.0 + self.read(name).float(), (size,))

    def attention_output(self, layer: int, attn: str) -> str:
        return self._post_norm(layer, attn, "post_attention_layernorm")

    def mlp_output(self, layer: int, y: str) -> str:
        return self._post_norm(layer, y, "post_feedforward_layernorm")

    def _post_norm(self, layer: int, x: str, which: str) -> str:
        weight = f"model.layers.{layer}.{which}.weight"
        return self.rms_norm(x, weight, f"/model/layers.{layer}/{which}", self.cfg.hidden_size)


class Gemma3Builder(Gemma2Builder):
    """Gemma 3 (text): Gemma 2 plus per-head q/k norms; its sliding layers' own rope base is
    config (ArchConfig.local_rope_theta: a second cos/sin cache)."""

    def qk_norm(self, layer: int, q: str, k: str) -> tuple[str, str]:
        return self.head_norms(layer, q, k)


class Phi3Builder(DecoderBuilder):
    """Phi-3 / Phi-3.5 / Phi-4(-mini): the checkpoint fuses q/k/v into qkv_proj and gate/up
    into gate_up_proj. The graph keeps the seven modules of the other families: each part's
    weight is its row slice of the fused tensor (ArchConfig.fused_modules gives the order),
    so LoRA targets, kernels and adapters on fused modules (adapters/fused.py) stay simple."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fused: tuple[str, object] = ("", None)  # the fused tensor last read, by name

    def projection_weight(self, layer: int, prefix: str, module: str) -> str:
        fused = self._fused_rows(layer, prefix, module)
        if fused is None:
            return super().projection_weight(layer, prefix, module)
        name, parts, rows = fused
        tensor = self._fused_tensor(name, parts)[rows]  # [out, in]
        sizes = self.cfg.module_sizes()[module]
        target = f"model.layers.{layer}.{prefix}.{module}.weight"
        return self.initializer_from(target, tensor, (sizes["out"], sizes["in"]), True)

    def projection_quantized(self, layer: int, prefix: str, module: str):
        fused = self._fused_rows(layer, prefix, module)
        if fused is None:
            return super().projection_quantized(layer, prefix, module)
        name, parts, rows = fused
        sizes = self.cfg.module_sizes()
        shape = (sum(sizes[p]["out"] for p in parts), sizes[parts[0]]["in"])
        if self._fused[0] != name:
            self._fused = (name, self.quantizer.linear(name, shape))
        return self._fused[1].rows(rows)  # blocks run along `in`: any rows keep them whole

    def _fused_rows(self, layer: int, prefix: str, module: str):
        """(fused checkpoint tensor, its parts, the rows of `module`), or None if unfused."""
        fused = [f for f, parts in self.cfg.fused_modules.items() if module in parts]
        if not fused:
            return None
        sizes = self.cfg.module_sizes()
        parts = self.cfg.fused_modules[fused[0]]
        start = sum(sizes[p]["out"] for p in parts[: parts.index(module)])
        name = f"model.layers.{layer}.{prefix}.{fused[0]}.weight"
        return name, parts, slice(start, start + sizes[module]["out"])

    def _fused_tensor(self, name: str, parts: list[str]):
        if self._fused[0] != name:
            tensor = self.read(name)
            sizes = self.cfg.module_sizes()
            shape = (sum(sizes[p]["out"] for p in parts), sizes[parts[0]]["in"])
            if tuple(tensor.shape) != shape:
                raise ExportError(
                    f"tensor {name} has shape {list(tensor.shape)}; the config implies "
                    f"{list(shape)} ({' + '.join(parts)} rows)"
                )
            self._fused = (name, tensor)
        return self._fused[1]


BUILDERS = {
    "llama": LlamaBuilder,
    "mistral": MistralBuilder,
    "qwen2": Qwen2Builder,
    "qwen3": Qwen3Builder,
    "gemma2": Gemma2Builder,
    "gemma3": Gemma3Builder,
    "phi3": Phi3Builder,
    "granite": GraniteBuilder,
}
