"""Which blocks each weight gets in a quantized export (`--weights int4|int8`).

    linear layers   `bits` (4 or 8), block `block_size`; from a GGUF file its Q4_0 / Q4_1 /
                    Q8_0 blocks carried over as they are (gguf_blocks.py), everything else
                    round-to-nearest (quant.py): int4 asymmetric, int8 symmetric
    embedding and   8 bits, symmetric (GatherBlockQuantized and MatMulNBits share them when
    LM head         tied); Q8_0 / Q4_0 carried over, anything else round-to-nearest

Every carried-over tensor is checked against the checkpoint's own dequantized tensor (what
transformers computes from the same file): the exact mappings must reproduce it, and the
largest difference of each method goes into the manifest.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ort_lora.export.errors import ExportError
from ort_lora.export.gguf_blocks import GGUF_BLOCK, Q4_1_MODES, map_blocks
from ort_lora.export.quant import (
    BlockQuantized,
    check_block_size,
    check_divides,
    quantize_hqq,
    quantize_rtn,
)

WEIGHTS = {"int4": 4, "int8": 8}
ACCURACY_LEVELS = (0, 1, 4)  # MatMulNBits on CPU: 0/1 float32 compute, 4 int8 activations
# what multiplies 4-bit linear weights at accuracy_level 4: our VNNI kernel or ORT's MLAS one
INT4_OPS = ("QuantMatMul", "MatMulNBits")
# how 4-bit linear weights that are not carried over are made: round-to-nearest, or refined
QUANT_METHODS = ("rtn", "hqq")
HEAD_BITS = 8
# a carried-over tensor that should be exact may differ from the checkpoint by float32
# rounding of d * q + m (relative to the tensor's largest value), never more
EXACT_RTOL = 1e-6


@dataclass(frozen=True)
class QuantConfig:
    """How a quantized export stores its weights (the manifest's `quantization` records it).

    accuracy_level 4 (int8 activations, int32 accumulation) is the fast one on x86 CPUs
    with AVX2 / AVX-512 VNNI: docs/BENCHMARK_NOTES.md measures it against levels 0 and 1."""

    weights: str  # "int4" | "int8"
    block_size: int = 32
    accuracy_level: int = 4
    gguf_q4_1: str = "offset"  # how GGUF Q4_1 blocks map: "offset" (exact) | "zero_point"
    int4_op: str = "QuantMatMul"  # 4-bit linears at accuracy_level 4: ort_lora's op or ORT's
    quant_method: str = "rtn"  # 4-bit linears not carried over: "rtn" | "hqq" (quant.py)

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise ExportError(f"--weights {self.weights!r}: expected int4 or int8 for MatMulNBits")
        check_block_size(self.block_size)
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ExportError(
                f"accuracy_level {self.accuracy_level!r}: expected one of {ACCURACY_LEVELS}"
            )
        if self.gguf_q4_1 not in Q4_1_MODES:
            raise ExportError(f"gguf_q4_1 {self.gguf_q4_1!r}: expected one of {Q4_1_MODES}")
        if self.int4_op not in INT4_OPS:
            raise ExportError(f"int4_op {self.int4_op!r}: expected one of {INT4_OPS}")
        if self.quant_method not in QUANT_METHODS:
            raise ExportError(
                f"quant_method {self.quant_method!r}: expected one of {QUANT_METHODS}"
            )
        if self.quant_method == "hqq" and self.weights != "int4":
            raise ExportError("quant_method hqq refines 4-bit weights: use it with --weights int4")

    @property
    def linear_op(self) -> str:
        """The op of 4-bit linear weights: ort_lora.QuantMatMul needs int8 activations."""
        return self.int4_op if self.bits == 4 and self.accuracy_level == 4 else "MatMulNBits"

    @property
    def bits(self) -> int:
        return WEIGHTS[self.weights]


class Quantizer:
    """Block-quantized weights by checkpoint tensor name, with a record of how each was made."""

    def __init__(self, config: QuantConfig, source, read):
        self.config, self.read = config, read  # read(name) -> torch tensor (counts progress)
        self.gguf = getattr(source, "gguf_tensors", lambda: None)()
        self._methods: dict[str, int] = defaultdict(int)
        self._max_diff: dict[str, float] = defaultdict(float)
        self._cache: dict[str, BlockQuantized] = {}

    def linear(self, name: str, shape: tuple[int, int]) -> BlockQuantized:
        """The weight [out, in] of a linear layer at the export's bits."""
        bits, symmetric = self.config.bits, self.config.bits == 8
        return self._quantize(name, shape, bits, symmetric, offsets=True)

    def embedding(self, name: str, shape: tuple[int, int]) -> BlockQuantized:
        """The embedding / LM head [vocab, hidden]: 8 bits, symmetric, no offsets (read once)."""
        if name not in self._cache:
            self._cache[name] = self._quantize(name, shape, HEAD_BITS, True, offsets=False)
        return self._cache[name]

    def _quantize(self, name, shape, bits, symmetric, offsets: bool) -> BlockQuantized:
        tensor = self.read(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ExportError(
                f"tensor {name} has shape {list(tensor.shape)}; the config implies {list(shape)}"
            )
        check_divides(self.config.block_size, name, shape[1])
        w = tensor.float().numpy()
        mapped = self._mapped(name, bits, offsets)
        if mapped is not None:
            self._record(mapped, w, exact="zero point" not in mapped.method)
            return mapped
        if self.config.quant_method == "hqq" and bits == 4 and not symmetric:
            q = quantize_hqq(w, self.config.block_size)
        else:
            q = quantize_rtn(w, bits, self.config.block_size, symmetric)
        if self.gguf is not None:
            q = _renamed(q, f"{q.method} from gguf {self.gguf.ggml_type(name)}")
        self._record(q, w, exact=False)
        return q

    def _mapped(self, name: str, bits: int, offsets: bool) -> BlockQuantized | None:
        if self.gguf is None or self.config.block_size != GGUF_BLOCK:
            return None
        raw = self.gguf.raw_rows(name)
        if raw is None:
            return None
        mapped = map_blocks(raw, self.gguf.ggml_type(name), bits, GGUF_BLOCK, self.config.gguf_q4_1)
        if mapped is not None and mapped.offsets is not None and not offsets:
            return None  # the embedding's GatherBlockQuantized has no offset input
        return mapped

    def _record(self, q: BlockQuantized, w: np.ndarray, exact: bool) -> None:
        diff = float(np.abs(q.dequantize() - w).max())
        if exact and diff > EXACT_RTOL * max(float(np.abs(w).max()), 1e-30):
            raise ExportError(  # a layout bug, never a property of the input
                f"internal error: GGUF blocks carried over as {q.method} differ from the "
                f"checkpoint's dequantized tensor by {diff:.3g}"
            )
        self._methods[q.method] += 1
        self._max_diff[q.method] = max(self._max_diff[q.method], diff)

    def summary(self) -> dict:
        """The manifest's `quantization` entry (see contract.py)."""
        c = self.config
        ops = {"QuantMatMul": "ort_lora.QuantMatMul", "MatMulNBits": "com.microsoft.MatMulNBits"}
        return {
            "weights": c.weights,
            "op": "com.microsoft.MatMulNBits",
            "linear_op": ops[c.linear_op],
            "head_op": ops[c.linear_op],  # the 8-bit LM head runs on the 4-bit linears' op
            "bits": c.bits,
            "block_size": c.block_size,
            "accuracy_level": c.accuracy_level,
            "linear": "int8 symmetric" if c.bits == 8 else "int4 asymmetric (zero points)",
            "quant_method": c.quant_method,
            "embedding_and_head_bits": HEAD_BITS,
            "gguf_q4_1": c.gguf_q4_1,
            "tensors_by_method": dict(self._methods),
            "max_abs_diff_vs_checkpoint": dict(self._max_diff),
        }


def _renamed(q: BlockQuantized, method: str) -> BlockQuantized:
    from dataclasses import replace

    return replace(q, method=method)
