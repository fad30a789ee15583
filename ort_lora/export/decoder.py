"""The decoder-only graph shared by every architecture family (see contract.py for I/O).

    input_ids ─ Gather(embed) ─┬──────────────── residual ───────────────┐
                               └ RMSNorm ─ q/k/v MatMul(+bias) ─ LoraSGMV ─ PagedAttention
        ─ o MatMul ─ LoraSGMV ─ SkipRMSNorm(+residual) ─ gate/up MatMul ─ LoraSGMV
        ─ SiLU(gate)*up ─ down MatMul ─ LoraSGMV ─ (next layer's SkipRMSNorm) ...
    last layer: Gather(logits_indices) on both the output and the residual ─ SkipRMSNorm
        ─ lm_head Gemm(transB) ─ logits

Families override two hooks: `attention_window` (Mistral) and `qk_norm` (Qwen3).
"""

from __future__ import annotations

import math

from ort_lora import contract as C
from ort_lora.export.arch import ArchConfig
from ort_lora.export.errors import ExportError
from ort_lora.export.graph import GraphBuilder, to_numpy
from ort_lora.export.loader import CheckpointSource
from ort_lora.export.rope import cos_sin_cache

MSFT = "com.microsoft"


class DecoderBuilder:
    """Builds the graph of a Llama-style decoder from checkpoint tensors, streaming weights."""

    def __init__(
        self,
        cfg: ArchConfig,
        source: CheckpointSource,
        graph: GraphBuilder,
        *,
        dtype: str,
        device: str,
        lora_targets: list[str],
        block_size: int,
        adapter_dtype: str | None = None,
        progress=None,
    ):
        self.cfg, self.src, self.g = cfg, source, graph
        self.dtype, self.device, self.targets = dtype, device, lora_targets
        self.block_size, self.progress = block_size, progress
        # LoraSGMV attribute: bfloat16 rows in the float32 pool (absent: the pool's dtype)
        self.lora_attrs = {}
        if adapter_dtype is not None:
            self.lora_attrs["adapter_dtype"] = C.ADAPTER_DTYPE_ATTR[adapter_dtype]

    # ---- weights ----------------------------------------------------------------------------
    def weight(self, name: str, shape: tuple[int, ...], transpose: bool = False) -> str:
        """Checkpoint tensor `name` (checked to be `shape`) as an initializer of the graph."""
        tensor = self.src.get(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ExportError(
                f"tensor {name} has shape {list(tensor.shape)}; the config implies {list(shape)}"
            )
        data = to_numpy(tensor, self.dtype, transpose)
        del tensor
        if self.progress is not None:
            self.progress.update(1)
        return self.g.initializer(name, data, self.dtype)

    # ---- graph inputs -----------------------------------------------------------------------
    def declare_inputs(self) -> None:
        g, cfg = self.g, self.cfg
        g.input(C.INPUT_IDS, "int64", ["T"])
        g.input(C.POSITION_IDS, "int64", ["T"])
        g.input(C.CU_SEQLENS, "int32", ["B_plus_1"])
        g.input(C.PAST_SEQLENS, "int32", ["B"])
        g.input(C.BLOCK_TABLE, "int32", ["B", "max_blocks"])
        g.input(C.SLOT_MAPPING, "int32", ["T"])
        if self.device == "cuda":  # ORT's CUDA PagedAttention; the CPU op derives the bounds
            g.input(C.ATTENTION_METADATA, "int32", [3])
        g.input(C.LOGITS_INDICES, "int64", ["N"])
        cache_shape = ["num_pages", self.block_size, cfg.num_kv_heads, cfg.head_dim]
        for layer in range(cfg.num_layers):
            g.input(C.key_cache_name(layer), self.dtype, cache_shape)
            g.input(C.value_cache_name(layer), self.dtype, cache_shape)
        g.input(C.LORA_SEG_STARTS, "int32", ["S_plus_1"])
        g.input(C.LORA_SEG_SLOTS, "int32", ["S"])
        for m in self.targets:
            g.input(C.lora_input_name(m, "a_offsets"), "int64", ["num_slots", f"max_rank_{m}"])
            g.input(C.lora_input_name(m, "b_offsets"), "int64", ["num_slots", f"max_rank_{m}"])
            g.input(C.lora_input_name(m, "ranks"), "int32", [cfg.num_layers, "num_slots"])
            g.input(C.lora_input_name(m, "scales"), "float32", [cfg.num_layers, "num_slots"])

    # ---- building blocks --------------------------------------------------------------------
    def linear(self, layer: int, x: str, prefix: str, module: str) -> str:
        """y = x @ W^T (+ b), then the LoRA delta if `module` is a target.  x: [T, in]."""
        sizes = self.cfg.module_sizes()[module]
        hf = f"model.layers.{layer}.{prefix}.{module}"
        name = f"/model/layers.{layer}/{prefix}/{module}"
        w = self.weight(f"{hf}.weight", (sizes["out"], sizes["in"]), transpose=True)
        (y,) = self.g.node("MatMul", [x, w], f"{name}/MatMul")  # [T, out]
        if self.src.has(f"{hf}.bias"):
            b = self.weight(f"{hf}.bias", (sizes["out"],))
            (y,) = self.g.node("Add", [y, b], f"{name}/Add")
        if module not in self.targets:
            return y
        lora_inputs = [y, x, C.key_cache_name(layer), C.value_cache_name(layer)]
        lora_inputs += [C.LORA_SEG_STARTS, C.LORA_SEG_SLOTS]
        lora_inputs += [C.lora_input_name(module, k) for k in ("a_offsets", "b_offsets")]
        lora_inputs += [C.lora_input_name(module, k) for k in ("ranks", "scales")]
        (y,) = self.g.node(
            "LoraSGMV",
            lora_inputs,
            f"{name}/LoraSGMV",
            domain=C.OPS_DOMAIN,
            layer=layer,
            **self.lora_attrs,
        )
        return y  # [T, out]

    def rms_norm(self, x: str, weight: str, name: str, size: int) -> str:
        w = self.weight(weight, (size,))
        (y,) = self.g.node(
            "SimplifiedLayerNormalization",
            [x, w],
            name,
            axis=-1,
            epsilon=self.cfg.rms_norm_eps,
            stash_type=1,
        )
        return y

    def skip_rms_norm(self, x: str, skip: str, weight: str, name: str) -> tuple[str, str]:
        """(norm(x + skip), x + skip)."""
        w = self.weight(weight, (self.cfg.hidden_size,))
        outs = self.g.node(
            "SkipSimplifiedLayerNormalization",
            [x, skip, w],
            name,
            domain=MSFT,
            n_out=4,
            epsilon=self.cfg.rms_norm_eps,
        )
        node = self.g.nodes[-1]
        node.output[1], node.output[2] = "", ""
        return outs[0], outs[3]

    # ---- family hooks -----------------------------------------------------------------------
    def attention_window(self) -> int:
        """PagedAttention local_window_size: -1 = global attention."""
        return -1

    def qk_norm(self, layer: int, q: str, k: str) -> tuple[str, str]:
        return q, k

    # ---- layers -----------------------------------------------------------------------------
    def attention(self, layer: int, h: str, cos: str, sin: str) -> str:
        cfg = self.cfg
        q = self.linear(layer, h, "self_attn", "q_proj")  # [T, heads * head_dim]
        k = self.linear(layer, h, "self_attn", "k_proj")  # [T, kv_heads * head_dim]
        v = self.linear(layer, h, "self_attn", "v_proj")  # [T, kv_heads * head_dim]
        q, k = self.qk_norm(layer, q, k)
        inputs = [
            q,
            k,
            v,
            C.key_cache_name(layer),
            C.value_cache_name(layer),
            C.CU_SEQLENS,
            C.PAST_SEQLENS,
            C.BLOCK_TABLE,
            cos,
            sin,
            C.SLOT_MAPPING,
        ]
        domain = C.OPS_DOMAIN
        if self.device == "cuda":
            # inputs 11..15 (head_sink, q/k norm weights, k/v scales) are absent; 16 is the
            # host-side bounds that spare ORT a device-to-host copy and sync per layer
            inputs += [""] * 5 + [C.ATTENTION_METADATA]
            domain = MSFT
        (attn,) = self.g.node(
            "PagedAttention",
            inputs,
            f"/model/layers.{layer}/self_attn/PagedAttention",
            domain=domain,
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            scale=1.0 / math.sqrt(cfg.head_dim),
            do_rotary=1,
            rotary_interleaved=0,
            local_window_size=self.attention_window(),
            softcap=0.0,
        )  # [T, heads * head_dim]
        return self.linear(layer, attn, "self_attn", "o_proj")  # [T, hidden]

    def mlp(self, layer: int, h: str) -> str:
        name = f"/model/layers.{layer}/mlp"
        gate = self.linear(layer, h, "mlp", "gate_proj")  # [T, inter]
        up = self.linear(layer, h, "mlp", "up_proj")  # [T, inter]
        (sig,) = self.g.node("Sigmoid", [gate], f"{name}/act/Sigmoid")
        (act,) = self.g.node("Mul", [gate, sig], f"{name}/act/Mul")
        (prod,) = self.g.node("Mul", [act, up], f"{name}/Mul")
        return self.linear(layer, prod, "mlp", "down_proj")  # [T, hidden]

    def decoder_layer(self, layer: int, x: str, residual: str | None, rope) -> tuple[str, str]:
        """(layer output before its residual add, residual stream)."""
        prefix, name = f"model.layers.{layer}", f"/model/layers.{layer}"
        if residual is None:
            h = self.rms_norm(
                x,
                f"{prefix}.input_layernorm.weight",
                f"{name}/input_layernorm",
                self.cfg.hidden_size,
            )
            residual = x
        else:
            h, residual = self.skip_rms_norm(
                x, residual, f"{prefix}.input_layernorm.weight", f"{name}/input_layernorm"
            )
        attn = self.attention(layer, h, *rope)
        h, residual = self.skip_rms_norm(
            attn,
            residual,
            f"{prefix}.post_attention_layernorm.weight",
            f"{name}/post_attention_layernorm",
        )
        return self.mlp(layer, h), residual

    def rope_caches(self) -> tuple[str, str]:
        cfg = self.cfg
        cos, sin = cos_sin_cache(
            cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        )  # [max_pos, head_dim / 2]
        import torch

        cos = to_numpy(torch.from_numpy(cos), self.dtype)
        sin = to_numpy(torch.from_numpy(sin), self.dtype)
        return (
            self.g.initializer("cos_cache", cos, self.dtype),
            self.g.initializer("sin_cache", sin, self.dtype),
        )

    def lm_head(self, x: str, residual: str) -> None:
        cfg, g = self.cfg, self.g
        rows_x = g.node("Gather", [x, C.LOGITS_INDICES], "/model/logits_rows/x", axis=0)[0]
        rows_r = g.node("Gather", [residual, C.LOGITS_INDICES], "/model/logits_rows/res", axis=0)[
            0
        ]  # [N, hidden]
        h, _ = self.skip_rms_norm(rows_x, rows_r, "model.norm.weight", "/model/norm")
        shape = (cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings or not self.src.has("lm_head.weight"):
            head = "model.embed_tokens.weight"  # the embedding initializer, reused
        else:
            head = self.weight("lm_head.weight", shape)
        (logits,) = g.node("Gemm", [h, head], "/lm_head/Gemm", transB=1)  # [N, vocab]
        if self.dtype != "float32":
            (logits,) = g.node("Cast", [logits], "/lm_head/Cast", to=1)
        g.rename_output(logits, C.LOGITS)
        g.output(C.LOGITS, "float32", ["N", cfg.vocab_size])

    def build(self) -> None:
        cfg = self.cfg
        self.declare_inputs()
        embed = self.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        (x,) = self.g.node("Gather", [embed, C.INPUT_IDS], "/model/embed_tokens/Gather")
        rope = self.rope_caches()
        residual = None
        for layer in range(cfg.num_layers):
            x, residual = self.decoder_layer(layer, x, residual, rope)  # [T, hidden] each
        self.lm_head(x, residual)


def expected_tensor_count(cfg: ArchConfig, names: set[str]) -> int:
    """How many checkpoint tensors the builder reads (for the progress bar)."""
    used = [n for n in names if n.startswith(("model.layers.", "model.embed", "model.norm"))]
    head = 0 if cfg.tie_word_embeddings else int("lm_head.weight" in names)
    return len([n for n in used if "rotary_emb" not in n]) + head
