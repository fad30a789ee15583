"""The decoder-only graph shared by every architecture family (see contract.py for I/O).

One file though past ~400 lines, on purpose: DecoderBuilder is one graph, drawn below, whose
building blocks, hooks and layers call each other, and which every family (families.py)
subclasses to override a hook. Split, a reader would follow one layer's nodes, and a family
the method it overrides, across files.

    input_ids ─ Gather(embed) [─ Mul] ─┬──────────────── residual ───────────────┐
        └ RMSNorm ─ q/k/v MatMul ─ LoraSGMV(q, k, v) [─ +bias] [─ q/k RMSNorm]
        ─ PagedAttention ─ o MatMul ─ LoraSGMV [─ attention_output] ─ SkipRMSNorm(+residual)
        ─ gate/up MatMul ─ LoraSGMV(gate, up) ─ act(gate)*up ─ down MatMul ─ LoraSGMV
        [─ mlp_output] ─ (next layer's SkipRMSNorm) ...
    last layer: Gather(logits_indices) on both the output and the residual ─ SkipRMSNorm
        ─ lm_head Gemm(transB) [─ Div(logits_scaling)] [─ Div ─ Tanh ─ Mul (soft-capping)]
        ─ logits

On CPU the target modules that read one x (q/k/v, gate/up) share one LoraSGMV node (attribute
modules: one shrink of x against all their A rows, one call's fixed cost); CUDA graphs keep a
node per module (the CUDA op takes one).

Quantized exports (`quant`, quantizer.py) replace each MatMul, the embedding Gather and the
LM head Gemm with com.microsoft MatMulNBits / GatherBlockQuantized (quant_graph.py); the LoRA
ops still read the float input x and add their float32 delta to the quantized projection.

Numbers come from ArchConfig: a bracketed node exists only when the config asks for it
(embedding / residual multipliers, logits scaling, final soft-capping), and PagedAttention's
scale, softcap and local_window_size attributes carry the attention ones, so a model that
uses none of them gets the plain Llama graph. Structure comes from family hooks (families.py):
`projection_weight` (fused checkpoint modules), `norm_weight` (Gemma's 1 + w), `qk_norm`,
`attention_output` / `mlp_output` (what joins the residual stream) and `pre_mlp_norm`.
"""

from __future__ import annotations

import math

from ort_lora import contract as C
from ort_lora.adapter_rows import AUTO, ROW_TYPES
from ort_lora.export.arch import ArchConfig
from ort_lora.export.errors import ExportError
from ort_lora.export.graph import GraphBuilder, to_numpy
from ort_lora.export.loader import CheckpointSource
from ort_lora.export.quant import BlockQuantized
from ort_lora.export.quant_graph import QuantGraph
from ort_lora.export.quantizer import QuantConfig, Quantizer
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
        quant: QuantConfig | None = None,
        progress=None,
    ):
        self.cfg, self.src, self.g = cfg, source, graph
        self.dtype, self.device, self.targets = dtype, device, lora_targets
        self.block_size, self.progress = block_size, progress
        # LoraSGMV attribute: 16-bit or int8 rows in the float32 pool (absent: the pool's
        # dtype); "auto": no attribute, each slot's type from the input lora_row_types
        self.row_types = adapter_dtype == AUTO
        self.lora_attrs = {}
        if adapter_dtype is not None and not self.row_types:
            self.lora_attrs["adapter_dtype"] = ROW_TYPES[adapter_dtype]
        self.quantizer = None if quant is None else Quantizer(quant, source, self.read)
        self.qgraph = None
        if quant is not None:
            self.qgraph = QuantGraph(graph, quant.accuracy_level, quant.linear_op)

    # ---- weights ----------------------------------------------------------------------------
    def weight(self, name: str, shape: tuple[int, ...], transpose: bool = False) -> str:
        """Checkpoint tensor `name` (checked to be `shape`) as an initializer of the graph."""
        return self.initializer_from(name, self.read(name), shape, transpose)

    def read(self, name: str):
        """Checkpoint tensor `name` (counted by the progress bar)."""
        tensor = self.src.get(name)
        if self.progress is not None:
            self.progress.update(1)
        return tensor

    def initializer_from(self, name: str, tensor, shape: tuple, transpose: bool = False) -> str:
        """`tensor` (checked to be `shape`) as initializer `name` in the graph's dtype."""
        if tuple(tensor.shape) != tuple(shape):
            raise ExportError(
                f"tensor {name} has shape {list(tensor.shape)}; the config implies {list(shape)}"
            )
        return self.g.initializer(name, to_numpy(tensor, self.dtype, transpose), self.dtype)

    def scalar(self, name: str, value: float, dtype: str | None = None) -> str:
        """A scalar initializer, rounded to `dtype` (default: the graph's) as the model does."""
        import torch

        dtype = dtype or self.dtype
        return self.g.initializer(name, to_numpy(torch.tensor(float(value)), dtype), dtype)

    def scaled(self, x: str, factor: float, name: str, dtype: str | None = None) -> str:
        """x * factor; no node when factor is 1."""
        if factor == 1.0:
            return x
        (y,) = self.g.node("Mul", [x, self.scalar(f"{name}/factor", factor, dtype)], name)
        return y

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
        g.input(C.LORA_COMP_SEGS, "int32", ["E"])
        g.input(C.LORA_COMP_SLOTS, "int32", ["E"])
        g.input(C.LORA_COMP_WEIGHTS, "float32", ["E"])
        for m in self.targets:
            g.input(C.lora_input_name(m, "a_offsets"), "int64", ["num_slots", f"max_rank_{m}"])
            g.input(C.lora_input_name(m, "b_offsets"), "int64", ["num_slots", f"max_rank_{m}"])
            g.input(C.lora_input_name(m, "ranks"), "int32", [cfg.num_layers, "num_slots"])
            g.input(C.lora_input_name(m, "scales"), "float32", [cfg.num_layers, "num_slots"])
            g.input(C.lora_input_name(m, "dora_offsets"), "int64", ["num_dora_slots"])
        if self.row_types:
            g.input(C.LORA_ROW_TYPES, "int32", ["num_slots"])

    # ---- building blocks --------------------------------------------------------------------
    def linear(self, layer: int, x: str, prefix: str, module: str) -> str:
        """y = x @ W^T (+ b), then the LoRA delta if `module` is a target.  x: [T, in]."""
        return self.linears(layer, x, prefix, (module,))[0]

    def linears(self, layer: int, x: str, prefix: str, modules: tuple[str, ...]) -> list[str]:
        """linear() of each of `modules`, which read the same x: their projections (a quantized
        export multiplies by their weights stacked as one, quant_graph.py, unless their blocks
        differ), the LoRA deltas of the targets among them, then their biases."""
        ys = self.projections(layer, x, prefix, modules)  # [T, out_m] each
        targets = [m for m in modules if m in self.targets]
        groups = [targets] if self.device == "cpu" else [[m] for m in targets]
        deltas = {}
        for group in filter(None, groups):
            name = self.module_name(layer, prefix, "+".join(group))
            outs = self.lora(layer, x, [ys[modules.index(m)] for m in group], group, name)
            deltas.update(zip(group, outs))
        return [self.bias(layer, deltas.get(m, y), prefix, m) for y, m in zip(ys, modules)]

    def projections(self, layer: int, x: str, prefix: str, modules: tuple[str, ...]) -> list[str]:
        """y = x @ W^T of each of `modules` (no bias).  x: [T, in] -> [T, out_m] each."""
        if self.quantizer is None:
            ys = []
            for m in modules:
                w = self.projection_weight(layer, prefix, m)  # [in, out]
                name = f"{self.module_name(layer, prefix, m)}/MatMul"
                ys.append(self.g.node("MatMul", [x, w], name)[0])
            return ys
        parts = [self.projection_quantized(layer, prefix, m) for m in modules]  # [out, in] blocks
        weights = [self.module_weight(layer, prefix, m) for m in modules]
        stacked = BlockQuantized.stack(parts) if len(parts) > 1 else None
        if stacked is None:  # one module, or blocks that differ: one product each
            names = [self.module_name(layer, prefix, m) for m in modules]
            return [self.qgraph.matmul(x, *part) for part in zip(parts, weights, names)]
        name = self.module_name(layer, prefix, "+".join(modules))
        rows = [p.shape[0] for p in parts]
        return self.qgraph.stacked_matmul(x, stacked, weights, rows, name)

    @staticmethod
    def module_weight(layer: int, prefix: str, module: str) -> str:
        """The checkpoint name of a linear module's weight (fused modules: of its part)."""
        return f"model.layers.{layer}.{prefix}.{module}.weight"

    @staticmethod
    def module_name(layer: int, prefix: str, module: str) -> str:
        """The graph name prefix of a linear module's nodes."""
        return f"/model/layers.{layer}/{prefix}/{module}"

    def bias(self, layer: int, y: str, prefix: str, module: str) -> str:
        """y plus the module's bias, if the checkpoint has one; after LoraSGMV: DoRA scales
        W x + delta, not the bias."""
        bias = f"model.layers.{layer}.{prefix}.{module}.bias"
        if not self.src.has(bias):
            return y
        b = self.weight(bias, (self.cfg.module_sizes()[module]["out"],))
        name = self.module_name(layer, prefix, module)
        return self.g.node("Add", [y, b], f"{name}/Add")[0]  # [T, out]

    def lora(self, layer: int, x: str, ys: list[str], modules: list[str], name: str) -> list[str]:
        """One LoraSGMV node for `modules`, which read the same x: each y (= x @ W^T, no bias)
        plus each segment's adapter deltas, DoRA-scaled for DoRA segments (contract.py).
        x: [T, in], ys: [T, out_m] each -> [T, out_m] each."""
        inputs = [ys[0], x, C.key_cache_name(layer), C.value_cache_name(layer)]
        inputs += [C.LORA_SEG_STARTS, C.LORA_SEG_SLOTS, *self.lora_tables(modules[0])[:4]]
        inputs += [C.LORA_COMP_SEGS, C.LORA_COMP_SLOTS, C.LORA_COMP_WEIGHTS]
        inputs += [self.lora_tables(modules[0])[4]]
        for y, m in zip(ys[1:], modules[1:]):  # modules 1.. (attribute modules)
            inputs += [y, *self.lora_tables(m)]
        if self.row_types:  # after the absent further modules' inputs
            inputs += [""] * (C.LORA_SGMV_ROW_TYPES - len(inputs)) + [C.LORA_ROW_TYPES]
        attrs = dict(self.lora_attrs, modules=len(modules)) if len(modules) > 1 else self.lora_attrs
        return self.g.node(
            "LoraSGMV",
            inputs,
            f"{name}/LoraSGMV",
            domain=C.OPS_DOMAIN,
            n_out=len(modules),
            layer=layer,
            **attrs,
        )  # [T, out_m] each

    @staticmethod
    def lora_tables(module: str) -> list[str]:
        """The graph inputs of a module's LoRA tables, in LoraSGMV's per-module order."""
        return [C.lora_input_name(module, kind) for kind in C.LORA_INPUT_KINDS]

    def rms_norm(self, x: str, weight: str, name: str, size: int) -> str:
        w = self.norm_weight(weight, size)
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
        w = self.norm_weight(weight, self.cfg.hidden_size)
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

    def head_norms(self, layer: int, q: str, k: str) -> tuple[str, str]:
        """Per-head RMSNorm of q and k (weights self_attn.q_norm / k_norm, [head_dim])."""
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

    # ---- family hooks -----------------------------------------------------------------------
    pre_mlp_norm = "post_attention_layernorm"  # the norm between attention and MLP

    def projection_weight(self, layer: int, prefix: str, module: str) -> str:
        """The initializer [in, out] of a linear module's weight (checkpoint: [out, in])."""
        sizes = self.cfg.module_sizes()[module]
        name = self.module_weight(layer, prefix, module)
        return self.weight(name, (sizes["out"], sizes["in"]), transpose=True)

    def projection_quantized(self, layer: int, prefix: str, module: str) -> BlockQuantized:
        """A linear module's weight [out, in] as blocks (quantized exports)."""
        sizes = self.cfg.module_sizes()[module]
        name = self.module_weight(layer, prefix, module)
        return self.quantizer.linear(name, (sizes["out"], sizes["in"]))

    def norm_weight(self, name: str, size: int) -> str:
        """The initializer [size] an RMSNorm multiplies by."""
        return self.weight(name, (size,))

    def attention_window(self, layer: int) -> int:
        """PagedAttention local_window_size of `layer`: -1 = global attention. HF's
        sliding_window W means W visible keys including the token itself; the op's
        local_window_size w means keys j >= p - w are visible (w + 1 keys)."""
        window = self.cfg.window(layer)
        return -1 if window is None else window - 1

    def qk_norm(self, layer: int, q: str, k: str) -> tuple[str, str]:
        return q, k

    def attention_output(self, layer: int, attn: str) -> str:
        """What the attention block adds to the residual stream."""
        name = f"/model/layers.{layer}/self_attn/residual_multiplier"
        return self.scaled(attn, self.cfg.residual_multiplier, name)

    def mlp_output(self, layer: int, y: str) -> str:
        """What the MLP block adds to the residual stream."""
        return self.scaled(
            y, self.cfg.residual_multiplier, f"/model/layers.{layer}/mlp/residual_multiplier"
        )

    # ---- layers -----------------------------------------------------------------------------
    def attention(self, layer: int, h: str, cos: str, sin: str) -> str:
        cfg = self.cfg
        # q [T, heads * head_dim], k and v [T, kv_heads * head_dim]
        q, k, v = self.linears(layer, h, "self_attn", ("q_proj", "k_proj", "v_proj"))
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
            scale=cfg.attention_scale or 1.0 / math.sqrt(cfg.head_dim),
            do_rotary=1,
            rotary_interleaved=0,
            local_window_size=self.attention_window(layer),
            softcap=cfg.attn_softcap or 0.0,
        )  # [T, heads * head_dim]
        return self.linear(layer, attn, "self_attn", "o_proj")  # [T, hidden]

    def mlp(self, layer: int, h: str) -> str:
        name = f"/model/layers.{layer}/mlp"
        gate, up = self.linears(layer, h, "mlp", ("gate_proj", "up_proj"))  # [T, inter] each
        (prod,) = self.g.node("Mul", [self.activation(gate, f"{name}/act"), up], f"{name}/Mul")
        return self.linear(layer, prod, "mlp", "down_proj")  # [T, hidden]

    def activation(self, x: str, name: str) -> str:
        """SiLU, or GELU with the tanh approximation (ORT's FastGelu) for gelu_pytorch_tanh."""
        if self.cfg.activation == "gelu_pytorch_tanh":
            return self.g.node("FastGelu", [x], f"{name}/FastGelu", domain=MSFT)[0]
        (sig,) = self.g.node("Sigmoid", [x], f"{name}/Sigmoid")
        return self.g.node("Mul", [x, sig], f"{name}/Mul")[0]

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
        attn = self.attention_output(layer, self.attention(layer, h, *rope))
        norm = self.pre_mlp_norm
        h, residual = self.skip_rms_norm(
            attn, residual, f"{prefix}.{norm}.weight", f"{name}/{norm}"
        )
        return self.mlp_output(layer, self.mlp(layer, h)), residual

    def rope_caches(self) -> dict[str, tuple[str, str]]:
        """(cos, sin) initializers [max_pos, rotary_dim / 2] by layer type: one pair, or with
        local_rope_theta (Gemma 3) a second pair for the sliding layers."""
        cfg = self.cfg
        main = self._rope_cache("", cfg.rope_theta, cfg.rope_scaling)
        caches = {"full_attention": main, "sliding_attention": main}
        if cfg.local_rope_theta is not None:
            caches["sliding_attention"] = self._rope_cache("_local", cfg.local_rope_theta, None)
        return caches

    def _rope_cache(self, suffix: str, theta: float, scaling: dict | None) -> tuple[str, str]:
        import torch

        cfg = self.cfg
        tables = cos_sin_cache(cfg.max_position_embeddings, cfg.rotary_dim, theta, scaling)
        cos, sin = (to_numpy(torch.from_numpy(t), self.dtype) for t in tables)
        return (
            self.g.initializer(f"cos_cache{suffix}", cos, self.dtype),
            self.g.initializer(f"sin_cache{suffix}", sin, self.dtype),
        )

    def lm_head(self, x: str, residual: str) -> None:
        cfg, g = self.cfg, self.g
        rows_x = g.node("Gather", [x, C.LOGITS_INDICES], "/model/logits_rows/x", axis=0)[0]
        rows_r = g.node("Gather", [residual, C.LOGITS_INDICES], "/model/logits_rows/res", axis=0)[
            0
        ]  # [N, hidden]
        h, _ = self.skip_rms_norm(rows_x, rows_r, "model.norm.weight", "/model/norm")
        shape = (cfg.vocab_size, cfg.hidden_size)
        tied = cfg.tie_word_embeddings or not self.src.has("lm_head.weight")
        if self.quantizer is not None:
            head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            q = self.quantizer.embedding(head, shape)
            logits = self.qgraph.matmul(h, q, head, "/lm_head")  # [N, vocab]
        else:
            head = self.tied_head() if tied else self.weight("lm_head.weight", shape)
            (logits,) = g.node("Gemm", [h, head], "/lm_head/Gemm", transB=1)  # [N, vocab]
        if self.dtype != "float32":
            (logits,) = g.node("Cast", [logits], "/lm_head/Cast", to=1)
        logits = self.final_logits(logits)  # [N, vocab] float32
        g.rename_output(logits, C.LOGITS)
        g.output(C.LOGITS, "float32", ["N", cfg.vocab_size])

    def tied_head(self) -> str:
        """The LM head's weight when it is the embedding. On CPU (float32) a second initializer
        over the same bytes of the data file: ORT prepacks the Gemm's weight and frees the
        original, which it cannot do for an initializer the Gather also reads, so sharing one
        initializer kept the embedding twice in memory (the prepacked copy and the original,
        fully read by the prepacking); apart, the Gather's copy stays file-backed and only the
        rows it reads become resident. CUDA keeps one initializer (one copy on the device)."""
        embed = "model.embed_tokens.weight"
        if self.device == "cpu" and self.dtype == "float32":
            return self.g.alias("lm_head.weight", embed)
        return embed

    def final_logits(self, logits: str) -> str:
        """logits / logits_scaling, then cap * tanh(logits / cap); no node for neutral values."""
        cfg, g = self.cfg, self.g
        if cfg.logits_scaling != 1.0:
            divisor = self.scalar("/lm_head/logits_scaling", cfg.logits_scaling, "float32")
            (logits,) = g.node("Div", [logits, divisor], "/lm_head/logits_scaling/Div")
        if cfg.final_softcap:
            cap = self.scalar("/lm_head/softcap", cfg.final_softcap, "float32")
            (x,) = g.node("Div", [logits, cap], "/lm_head/softcap/Div")
            (x,) = g.node("Tanh", [x], "/lm_head/softcap/Tanh")
            (logits,) = g.node("Mul", [x, cap], "/lm_head/softcap/Mul")
        return logits

    def embedding(self) -> str:
        """The rows of input_ids in the embedding table: [T, hidden]."""
        name, shape = "model.embed_tokens.weight", (self.cfg.vocab_size, self.cfg.hidden_size)
        if self.quantizer is not None:
            q = self.quantizer.embedding(name, shape)
            return self.qgraph.gather(C.INPUT_IDS, q, name, "/model/embed_tokens")
        embed = self.weight(name, shape)
        return self.g.node("Gather", [embed, C.INPUT_IDS], "/model/embed_tokens/Gather")[0]

    def build(self) -> None:
        cfg = self.cfg
        self.declare_inputs()
        x = self.embedding()  # [T, hidden]
        x = self.scaled(x, cfg.embedding_multiplier, "/model/embed_tokens/Mul")  # [T, hidden]
        ropes = self.rope_caches()
        residual = None
        for layer in range(cfg.num_layers):
            rope = ropes[cfg.layer_types[layer]]
            x, residual = self.decoder_layer(layer, x, residual, rope)  # [T, hidden] each
        self.lm_head(x, residual)


def expected_tensor_count(cfg: ArchConfig, names: set[str]) -> int:
    """How many checkpoint tensors the builder reads (for the progress bar)."""
    used = [n for n in names if n.startswith(("model.layers.", "model.embed", "model.norm"))]
    head = 0 if cfg.tie_word_embeddings else int("lm_head.weight" in names)
    return len([n for n in used if "rotary_emb" not in n]) + head
