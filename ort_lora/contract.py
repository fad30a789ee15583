"""The graph contract between the exporter and the engine (overview: docs/DESIGN.md).

Input and output names of an exported model, the LoRA target modules, and the manifest that
describes an exported model directory. Pure data: imports neither onnxruntime nor torch.

Graph inputs (T packed tokens, B sequences, S LoRA segments, E composition entries):
  input_ids                  int64 [T]
  position_ids               int64 [T]
  cumulative_sequence_length int32 [B + 1]
  past_seqlens               int32 [B]
  block_table                int32 [B, max_blocks]
  slot_mapping               int32 [T]
  attention_metadata         int32 [3]      --device cuda graphs only: [max new tokens of a
                                            sequence, max kv length (past + new), the same
                                            max kv length]: bounds ORT's CUDA PagedAttention
                                            would otherwise read back from the GPU per layer
  logits_indices             int64 [N]      rows of T whose logits are returned (any N rows:
                                            usually each sequence's last, all prompt rows
                                            for prompt_logprobs)
  key_cache.{l}, value_cache.{l}  [num_pages, block_size, kv_heads, head_dim]  pool views
  lora_seg_starts            int32 [S + 1]  token segments, ordered by adapter slot
  lora_seg_slots             int32 [S]      slot of each segment (weight 1), -1 = none
  lora_comp_segs             int32 [E]      composition: entry e adds the adapter in slot
  lora_comp_slots            int32 [E]        lora_comp_slots[e], weighted lora_comp_weights[e],
  lora_comp_weights          float [E]        to the rows of segment lora_comp_segs[e]
  lora_{m}_a_offsets         int64 [num_slots, max_rank_m]  per target module m
  lora_{m}_b_offsets         int64 [num_slots, max_rank_m]
  lora_{m}_ranks             int32 [num_layers, num_slots]
  lora_{m}_scales            float [num_layers, num_slots]
  lora_{m}_dora_offsets      int64 [num_slots]  pool element of the slot's DoRA row, -1 = none
  lora_row_types             int32 [num_slots]  exports with adapter_dtype "auto": the type of
                                            each slot's rows (1 float32, 16 bfloat16, 10
                                            float16: LoraSGMV's input row_types); [0]: every
                                            slot float32 (ModelSession's until a run gives it)
The lora_comp_* and lora_{m}_dora_offsets inputs exist in exports whose manifest lists
"composition" and "dora" in lora_features (AdapterRegistry.lora_step_inputs feeds them: E = 0
and -1 for every slot when no request composes and no adapter is DoRA).
Output:
  logits                     float32 [N, vocab]

Attention, per layer: each layer's PagedAttention node (ours on CPU, com.microsoft's on CUDA,
the same attributes) carries that layer's own attributes, so the inputs above serve every
family: scale (Gemma: query_pre_attn_scalar ** -0.5, Granite: attention_multiplier, else
1 / sqrt(head_dim)), softcap (Gemma 2's attn_logit_softcapping; 0 = off) and
local_window_size (a sliding layer: sliding_window - 1; -1 = global). It reads its layer
type's rotary tables: initializers cos_cache / sin_cache, plus cos_cache_local /
sin_cache_local for Gemma 3's sliding layers (their own rope base); 2 * cos_cache.shape[1] is
the rotary dimension, below head_dim for partial rotary (Phi-3). A model that uses none of
these gets scale 1 / sqrt(head_dim), softcap 0 and window -1 in every layer.

LoRA weight placement (what LoraSGMV reads): in layer l, the pool share of that layer is
seen as one flat array, key_cache.{l} followed by value_cache.{l}. Row j of A (length in_m)
of the adapter in slot s starts at element a_offsets[s, j]; row j of B^T (length out_m) at
b_offsets[s, j]. An adapter occupies the same pages in every layer, so offsets are shared by
all layers; ranks and scales are per layer (rank_pattern / alpha_pattern / layers_to_transform).
No row straddles a page half, so a row is contiguous in memory.
LoraSGMV nodes (custom_ops/lora_sgmv/lora_sgmv_op.h): on CPU, the target modules of a layer that
read the same x share one node, attribute modules = M: q/k/v one (M = 3: module 0's y and tables
in the one-module node's places, modules 1 and 2 each adding y_m, a_offsets_m, b_offsets_m,
ranks_m, scales_m, dora_offsets_m and an output), o one, gate/up one (M = 2), down one; a
layer targeting only some of them has a node for those. Output m is exactly the one-module
op's on module m's inputs (numpy: ort_lora/ops/lora_sgmv_ref.py lora_sgmv_modules): the node
shares the shrink's pass over x and the call's fixed cost, not the numbers. --device cuda
graphs keep one node per module (the CUDA op takes one). The graph inputs are the same.
Rows hold the pool's dtype, except with manifest.adapter_dtype "bfloat16", "float16" or "int8"
in a float32 (CPU) pool (ort_lora/adapter_rows.py): bfloat16 and float16 rows hold two values
per pool element (the first in its low 16 bits), a row of n values occupying ceil(n / 2)
elements; int8 rows start with their float32 scale, then four int8 values per element (value =
scale * q), 1 + ceil(n / 4) elements. Every LoraSGMV node then carries the attribute
adapter_dtype = 16 (TensorProto.BFLOAT16), 10 (TensorProto.FLOAT16) or 3 (TensorProto.INT8).
Offsets still count pool elements. With manifest.adapter_dtype "auto" (the default of CPU
float32 exports) each adapter's rows take the type that holds its values exactly
(adapter_rows.exact_row_type: float16 or bfloat16 for an adapter saved in it, else float32),
and every LoraSGMV node reads the slots' types from the graph input lora_row_types (its input
row_types, after modules 1 and 2's: LORA_SGMV_ROW_TYPES) instead of an attribute.

Quantized base weights (manifest.quantization, --weights int4|int8; CPU, float32 activations
and pool): every linear module's MatMul is com.microsoft.MatMulNBits over blocks of
quantization.block_size input values (quantization.bits per value, accuracy_level as
recorded: 4 = the op quantizes its float input to int8 per block), the embedding Gather is
GatherBlockQuantized and the LM head MatMulNBits, both at embedding_and_head_bits (8). 4-bit
linear weights at accuracy_level 4 and the LM head of such an export are ort_lora.QuantMatMul
instead (linear_op, head_op; the same numbers in 64-column tiles for int8 dot products, bits
4 or 8, custom_ops/quant_matmul/quant_matmul_op.h, a GGUF Q4_1 offset as its input, not a
branch; 4-bit GGUF Q4_0 / Q4_1 blocks keep the file's float16 scales and minimums,
ort_lora/quant_tiles.py; the embedding's GatherBlockQuantized keeps the MatMulNBits layout).
Modules that read the same input (q/k/v, gate/up) share one product over their stacked rows,
whose output a Split cuts into the modules' y (export/quant_graph.py). The graph's inputs and
outputs, the pool and LoraSGMV are unchanged: LoraSGMV reads the float input x and adds its float32
delta to the quantized projection's output. The entry records:
  weights, bits, block_size, accuracy_level, op, linear_op, head_op   what the graph runs
  quant_method            "rtn" or "hqq": how linear weights not carried over from a GGUF
                          are made (hqq: int4 only, float zero points as integer ones plus
                          a per-block offset, quant.quantize_hqq)
  linear                  how round-to-nearest quantizes linear weights (int4: asymmetric
                          with zero points; int8: symmetric)
  embedding_and_head_bits 8 (symmetric)
  gguf_q4_1               how GGUF Q4_1 blocks map: "offset" (exact: the block's float
                          minimum as a per-block offset, blocksum(x) @ offsets^T added) or
                          "zero_point" (the op's integer zero point, the minimum rounded)
  tensors_by_method       method -> tensor count: "gguf Q4_0", "gguf Q4_1 (offset)",
                          "gguf Q4_1 (zero point)", "gguf Q8_0" (GGUF blocks carried over),
                          "rtn" (round-to-nearest from float), "rtn from gguf <type>"
  max_abs_diff_vs_checkpoint  method -> largest |dequantized export - checkpoint tensor| over
                          its tensors (the checkpoint tensor: what transformers reads; 0 up
                          to float32 rounding for the exact mappings)

Composition and DoRA (LoraSGMV, custom_ops/lora_sgmv/lora_sgmv_op.h; numpy reference
ort_lora/ops/lora_sgmv_ref.py). Segment s's adapters (its terms) are lora_seg_slots[s] with
weight 1 when >= 0, then its lora_comp_* entries in order; its rows get
sum over terms of w * scales[l, slot] * B A x, i.e. sum_i w_i s_i B_i (A_i x): PEFT's
add_weighted_adapter(combination_type="cat") of those adapters, without a merge. A DoRA adapter
(PEFT use_dora) has, per module and layer, a row D [out_m] in its pages beside A and B^T:
D = m / ||W + s B A||_row - 1 (m PEFT's lora_magnitude_vector, W the exported base weight, the
norm per output row, as PEFT's detached weight norm; stored minus one so that rounding to the
row type errs on the correction only), the same row type as A and B^T. A segment whose ONE
term is a DoRA slot gets y_out = (y + delta) * (1 + D); composing a DoRA adapter with others is
an error (PEFT defines no such composition). LoraSGMV's y is the projection W x without its
bias: a module's bias is added after LoraSGMV (PEFT scales W x + s B A x, never the bias).
The registry computes D when the adapter is loaded (adapters/dora.py): it reads the module's
base weight from the export itself (model.onnx's graph, initializers memory-mapped from its
external data; MatMulNBits weights dequantized), never loading the model a second time.

Fused checkpoint modules (manifest.fused_modules, e.g. Phi-3's qkv_proj -> q_proj, k_proj,
v_proj): the graph has the separate target modules, whose weights are row slices of the fused
one, in the listed order. A PEFT adapter on the fused module (A [r, in], B [sum of outs, r])
is served as the same A on every part with B's row slice of that part, at the fused module's
rank and scaling: exactly the fused delta, row by row (adapters/fused.py). A DoRA magnitude
on a fused module splits the same way: each part's rows keep their own m and norm.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

OPS_DOMAIN = "ort_lora"
MANIFEST_NAME = "ort_lora_manifest.json"
# The exporter's op set: raised when exports start using something new of the ops (0.2.0:
# LoraSGMV nodes over several modules, QuantMatMul over 8-bit weights; 0.3.0: LoraSGMV's
# row_types, each adapter's rows of its own type; 0.4.0: QuantMatMul's float16 scales and
# minimums, a GGUF file's own Q4_0 / Q4_1 numbers). Older exports keep running; caches that
# export for speed (the default model, benchmark models) redo them.
OPS_VERSION = "0.4.0"
MODEL_NAME = "model.onnx"

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
CU_SEQLENS = "cumulative_sequence_length"
PAST_SEQLENS = "past_seqlens"
BLOCK_TABLE = "block_table"
SLOT_MAPPING = "slot_mapping"
ATTENTION_METADATA = "attention_metadata"
LOGITS_INDICES = "logits_indices"
LORA_SEG_STARTS = "lora_seg_starts"
LORA_SEG_SLOTS = "lora_seg_slots"
LORA_COMP_SEGS = "lora_comp_segs"
LORA_COMP_SLOTS = "lora_comp_slots"
LORA_COMP_WEIGHTS = "lora_comp_weights"
LORA_ROW_TYPES = "lora_row_types"
LOGITS = "logits"

# What an export's LoraSGMV nodes take beyond one plain adapter per segment (manifest
# lora_features): "composition" (the lora_comp_* inputs), "dora" (lora_{m}_dora_offsets).
LORA_FEATURES = ("composition", "dora")
LORA_INPUT_KINDS = ("a_offsets", "b_offsets", "ranks", "scales", "dora_offsets")


def key_cache_name(layer: int) -> str:
    return f"key_cache.{layer}"


def value_cache_name(layer: int) -> str:
    return f"value_cache.{layer}"


def lora_input_name(module: str, kind: str) -> str:
    """kind is one of LORA_INPUT_KINDS: a_offsets, b_offsets, ranks, scales, dora_offsets."""
    assert module in LORA_MODULES and kind in LORA_INPUT_KINDS
    return f"lora_{module}_{kind}"


# A LoraSGMV node's inputs: y, x, the two caches, seg_starts, seg_slots, module 0's tables
# (LORA_INPUT_KINDS but dora_offsets), the three composition inputs, module 0's dora_offsets;
# then per further module m (attribute modules) its y and its LORA_INPUT_KINDS tables.
LORA_SGMV_ONE_MODULE_INPUTS = 14
LORA_SGMV_A_OFFSETS = 6  # module 0's a_offsets
LORA_SGMV_ROW_TYPES = 26  # row_types: after modules 1 and 2's inputs (3 modules at most)


def lora_sgmv_module_inputs(m: int) -> tuple[int, int]:
    """The input indices of module m's y and a_offsets in a LoraSGMV node."""
    if m == 0:
        return 0, LORA_SGMV_A_OFFSETS
    y = LORA_SGMV_ONE_MODULE_INPUTS + (1 + len(LORA_INPUT_KINDS)) * (m - 1)
    return y, y + 1


def current_manifest(model_dir: str | Path) -> dict | None:
    """The manifest (its JSON) of an export made with this version's op set (OPS_VERSION); None
    when there is none, it cannot be read, or an older op set made it."""
    try:
        manifest = json.loads((Path(model_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("ops_version") == OPS_VERSION else None


@dataclass
class ModelManifest:
    """Everything the engine needs to know about an exported model directory."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    device: str  # "cpu" | "cuda"
    # module name -> {"in": in_features, "out": out_features}
    lora_targets: dict[str, dict[str, int]]
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    sliding_window: int | None = None
    ops_version: str = OPS_VERSION  # the graph's op set as exported (OPS_VERSION)
    source: str = ""
    extra: dict = field(default_factory=dict)
    # None: rows in the pool's dtype; "bfloat16", "float16" or "int8" rows in a float32 pool;
    # "auto": each adapter's rows of the type that holds it exactly (float16, bfloat16, float32)
    adapter_dtype: str | None = None
    # fused checkpoint module -> the LORA_MODULES its output rows split into, in order
    fused_modules: dict[str, list[str]] = field(default_factory=dict)
    # what the LoraSGMV nodes take beyond one adapter per segment (LORA_FEATURES); none in a
    # manifest written before them (load)
    lora_features: list[str] = field(default_factory=lambda: list(LORA_FEATURES))
    # the directory the manifest was loaded from (not saved): where the adapter registry reads
    # base weights (DoRA)
    model_dir: str | None = field(default=None, compare=False)
    # {} for float weights; quantized exports (--weights int4|int8), see the module docstring
    quantization: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.adapter_dtype not in (None, "auto", "bfloat16", "float16", "int8") or (
            self.adapter_dtype is not None and self.dtype != "float32"
        ):
            raise ValueError(
                f"adapter_dtype {self.adapter_dtype!r} with dtype {self.dtype}: expected None "
                "(adapter rows in the pool's dtype), or 'auto', 'bfloat16', 'float16' or 'int8' "
                "with a float32 pool"
            )
        if self.quantization and (
            self.quantization.get("weights") not in ("int4", "int8")
            or (self.device, self.dtype) != ("cpu", "float32")
        ):
            raise ValueError(
                f"quantization {self.quantization.get('weights')!r} on {self.device} / "
                f"{self.dtype}: expected int4 or int8 weights with float32 on cpu"
            )
        if not set(self.lora_features) <= set(LORA_FEATURES):
            raise ValueError(
                f"lora_features {self.lora_features!r}: expected a subset of {list(LORA_FEATURES)}"
            )
        unknown = set(self.lora_targets) - set(LORA_MODULES)
        unknown |= {p for parts in self.fused_modules.values() for p in parts} - set(LORA_MODULES)
        if unknown:
            raise ValueError(
                f"unknown LoRA target modules {sorted(unknown)}; "
                f"expected a subset of {list(LORA_MODULES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def weights(self) -> str:
        """How the base weights are stored: "int4" / "int8" (MatMulNBits) or the dtype."""
        return self.quantization.get("weights", self.dtype)

    @property
    def page_elems(self) -> int:
        """Elements in one layer's K (or V) half of a page."""
        return self.block_size * self.num_kv_heads * self.head_dim

    def save(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / MANIFEST_NAME
        fields = asdict(self)
        del fields["model_dir"]
        path.write_text(json.dumps(fields, indent=2) + "\n")

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelManifest:
        path = Path(model_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir} is not an exported ort-lora model: "
                f"no {MANIFEST_NAME} (run `ort-lora export` first)"
            )
        fields = json.loads(path.read_text())
        fields.setdefault("lora_features", [])  # exported before composition and DoRA
        return cls(**fields, model_dir=str(Path(model_dir)))
