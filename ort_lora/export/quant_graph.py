"""Graph nodes for block-quantized weights (quant.py): linear layers and the embedding.

    x [T, K] ─ MatMulNBits(B, scales[, zero_points]) ─────────────────┬─ Add ─ y [T, N]
       └ (offsets only) Reshape [T, K/b, b] ─ ReduceSum ─ MatMul(offsets^T) ┘

    x [T, K] ─ ort_lora.QuantMatMul(tiles, tile_scales[, tile_zeros][, tile_offsets]) ─ y [T, N]
               (linear_op "QuantMatMul", at accuracy_level 4: 4- and 8-bit weights, the 8-bit
               LM head too; quant.tile_blocks)

    x [T, K] ─ (either, W = q/k/v or gate/up stacked by rows) ─ Split ─ y_q, y_k, y_v
    x [T, K] ─ QuantMatMul(stacked, splits = rows) ─ y_q, y_k, y_v   (parts of 64k rows: no Split)

    input_ids [T] ─ GatherBlockQuantized(B as [V, H * bits / 8], scales) ─ [T, H]

The offset branch exists only for weights with a per-block float offset (GGUF Q4_1 mapped
exactly); its block sums are computed once per input and shared by every weight that reads
that input. Linear modules that read the same input (q/k/v, gate/up) are one MatMulNBits
over their stacked rows, split after it (and after its offset branch): per decoder layer 4
MatMulNBits instead of 7, and 4 offset branches (about 3 ms of a 65 ms SmolLM2 decode step at
32 sequences). Initializers are named after the checkpoint tensor: `{weight}/quant/B`,
`/scales`, `/zero_points`, `/offsets_T`; stacked weights after their parts (stacked_name:
`model.layers.0.self_attn.q_proj+k_proj+v_proj.weight`), with `/quant/rows` (the Split's
sizes); QuantMatMul's `/quant/tiles`, `/tile_scales`, `/tile_zeros`, `/tile_offsets` (a tied
head's tiles are initializers of their own: the embedding's GatherBlockQuantized keeps reading
`/quant/B_rows` and `/scales`).
quant_reference.py and adapters/base_weights.py read the quantized weights back by these
names and nodes.
"""

from __future__ import annotations

import numpy as np

from ort_lora.contract import OPS_DOMAIN
from ort_lora.export.graph import GraphBuilder
from ort_lora.export.quant import BlockQuantized, tile_blocks
from ort_lora.quant_tiles import TILE

MSFT = "com.microsoft"
QUANT = "/quant/"


class QuantGraph:
    """Emits the nodes of quantized weights into a GraphBuilder (float32 activations)."""

    def __init__(self, graph: GraphBuilder, accuracy_level: int, linear_op: str = "MatMulNBits"):
        self.g, self.accuracy_level, self.linear_op = graph, accuracy_level, linear_op
        self._block_sums: dict[tuple[str, int], str] = {}
        self._written: set[str] = set()

    def matmul(self, x: str, q: BlockQuantized, weight: str, name: str) -> str:
        """y = x @ W^T for W = q (checkpoint tensor `weight`).  x: [T, K] -> [T, N]."""
        n, k = q.shape
        if self.linear_op == "QuantMatMul":
            return self._quant_matmul(x, q, weight, name, [n])[0]
        inputs = [x, self._init(f"{weight}{QUANT}B", q.codes, "uint8")]
        inputs.append(self._init(f"{weight}{QUANT}scales", q.scales, "float32"))
        zero_points = q.packed_zero_points()
        if zero_points is not None:
            inputs.append(self._init(f"{weight}{QUANT}zero_points", zero_points, "uint8"))
        (y,) = self.g.node(
            "MatMulNBits",
            inputs,
            f"{name}/MatMulNBits",
            domain=MSFT,
            K=k,
            N=n,
            bits=q.bits,
            block_size=q.block_size,
            accuracy_level=self.accuracy_level,
        )
        if q.offsets is None:
            return y
        sums = self.block_sums(x, k, q.block_size)  # [T, K / block]
        offsets_t = np.ascontiguousarray(q.offsets.T)  # [K / block, N]
        w = self._init(f"{weight}{QUANT}offsets_T", offsets_t, "float32")
        (extra,) = self.g.node("MatMul", [sums, w], f"{name}/offsets/MatMul")  # [T, N]
        return self.g.node("Add", [y, extra], f"{name}/offsets/Add")[0]

    def _quant_matmul(
        self, x: str, q: BlockQuantized, weight: str, name: str, splits: list[int]
    ) -> list[str]:
        """ort_lora.QuantMatMul over q in its tiles (quant.tile_blocks), offsets inside, its
        output cut by columns into `splits` (all but the last multiples of quant_tiles.TILE)."""
        t = tile_blocks(q)
        inputs = [x, self._init(f"{weight}{QUANT}tiles", t.codes, "uint8")]
        inputs.append(self._init(f"{weight}{QUANT}tile_scales", t.scales, t.scales.dtype.name))
        for field in ("zeros", "offsets"):
            data = getattr(t, field)
            name = f"{weight}{QUANT}tile_{field}"
            inputs.append("" if data is None else self._init(name, data, data.dtype.name))
        while inputs[-1] == "":
            inputs.pop()
        n, k = q.shape
        attrs = dict(K=k, N=n, bits=q.bits, block_size=q.block_size)
        if len(splits) > 1:
            attrs["splits"] = splits
        node = f"{name}/QuantMatMul"
        return self.g.node(
            "QuantMatMul", inputs, node, domain=OPS_DOMAIN, n_out=len(splits), **attrs
        )

    def stacked_matmul(
        self, x: str, q: BlockQuantized, weights: list[str], rows: list[int], name: str
    ) -> list[str]:
        """[x @ W_i^T for each part i] for W = q, the parts' rows (`rows` each) stacked;
        `weights` the parts' checkpoint tensors.  x: [T, K] -> [T, rows[i]] each."""
        weight = stacked_name(weights)
        if self.linear_op == "QuantMatMul" and not any(r % TILE for r in rows[:-1]):
            return self._quant_matmul(x, q, weight, name, rows)  # its outputs, no Split
        y = self.matmul(x, q, weight, name)  # [T, sum(rows)]
        sizes = self._init(f"{weight}{QUANT}rows", np.array(rows, np.int64), "int64")
        return self.g.node("Split", [y, sizes], f"{name}/Split", n_out=len(rows), axis=1)

    def gather(self, ids: str, q: BlockQuantized, weight: str, name: str) -> str:
        """Rows `ids` of W = q, dequantized.  ids: [T] -> [T, K]."""
        assert q.zeros is None and q.offsets is None, "the embedding is quantized symmetrically"
        n, k = q.shape
        data = self._init(f"{weight}{QUANT}B_rows", q.codes.reshape(n, -1), "uint8")
        scales = self._init(f"{weight}{QUANT}scales", q.scales, "float32")
        (y,) = self.g.node(
            "GatherBlockQuantized",
            [data, ids, scales],
            f"{name}/GatherBlockQuantized",
            domain=MSFT,
            gather_axis=0,
            quantize_axis=1,
            block_size=q.block_size,
            bits=q.bits,
        )
        return y

    def block_sums(self, x: str, k: int, block_size: int) -> str:
        """Sum of each block of `block_size` values of x [T, K] -> [T, K / block_size]."""
        key = (x, block_size)
        if key not in self._block_sums:
            name = f"{x.rsplit('/output_', 1)[0]}/block_sums_{block_size}"
            shape = self.g.constant_i64(f"{name}/shape", [-1, k // block_size, block_size])
            (blocks,) = self.g.node("Reshape", [x, shape], f"{name}/Reshape")
            axes = self.g.constant_i64(f"{name}/axes", [2])
            (sums,) = self.g.node("ReduceSum", [blocks, axes], f"{name}/ReduceSum", keepdims=0)
            self._block_sums[key] = sums
        return self._block_sums[key]

    def _init(self, name: str, data: np.ndarray, dtype: str) -> str:
        if name not in self._written:  # a tied MatMulNBits head shares the embedding's scales
            self.g.initializer(name, data, dtype)
            self._written.add(name)
        return name


def stacked_name(weights: list[str]) -> str:
    """The name of stacked weights: [P.q_proj.weight, P.k_proj.weight] -> P.q_proj+k_proj.weight."""
    prefix, leaf = weights[0].rsplit(".", 2)[0], weights[0].rsplit(".", 1)[1]
    modules = [w.rsplit(".", 2)[1] for w in weights]
    assert all(w == f"{prefix}.{m}.{leaf}" for w, m in zip(weights, modules)), weights
    return f"{prefix}.{'+'.join(modules)}.{leaf}"


def stacked_parts(weight: str) -> list[str]:
    """stacked_name's inverse; [weight] for a weight that is not stacked."""
    if "+" not in weight:
        return [weight]
    prefix, modules, leaf = weight.rsplit(".", 2)
    return [f"{prefix}.{m}.{leaf}" for m in modules.split("+")]


def check_runtime(config) -> None:
    """An ExportError unless this onnxruntime runs MatMulNBits at the config's bits, block size
    and accuracy level, and 8-bit MatMulNBits / GatherBlockQuantized (embedding and head), on
    its CPU provider."""
    import onnxruntime as ort

    from ort_lora.export.errors import ExportError
    from ort_lora.export.quant import quantize_rtn

    block = config.block_size
    w = np.linspace(-1.0, 1.0, 2 * block, dtype=np.float32).reshape(2, block)
    for bits in dict.fromkeys((config.bits, 8)):
        g = GraphBuilder(_InlineWriter(), "probe")
        g.input("x", "float32", [1, block])
        g.input("ids", "int64", [1])
        qg = QuantGraph(g, config.accuracy_level)
        q = quantize_rtn(w, bits, block, symmetric=True)
        for out in (qg.matmul("x", q, "w", "/mm"), qg.gather("ids", q, "w", "/gather")):
            g.output(out, "float32", None)
        model = g.model({"": 17, MSFT: 1})
        model.ir_version = 8
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ExportError(
                f"--weights {config.weights}: this onnxruntime ({ort.__version__}) cannot run "
                f"com.microsoft.MatMulNBits / GatherBlockQuantized with bits={bits}, "
                f"block_size={block}, accuracy_level={config.accuracy_level} on CPU: "
                f"{str(e).splitlines()[0]}"
            ) from None


class _InlineWriter:
    """An ExternalDataWriter stand-in that keeps every tensor inside the model proto."""

    def tensor(self, name: str, data: np.ndarray, elem_type: str):
        from onnx import numpy_helper

        return numpy_helper.from_array(np.ascontiguousarray(data), name)
