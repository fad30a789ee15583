"""The exported model's base weights, read back for DoRA (adapters/dora.py) without loading the
model a second time.

`ExportedWeights(model_dir).rows(layer, module, start, stop)` returns rows [start, stop) of the
weight W [out, in] that the graph's base projection of (layer, module) multiplies by
(y = x @ W^T). It reads model.onnx's graph once (protobuf only: initializers stay in the
external data file) and finds, for each module of each LoraSGMV node (a node may serve several
modules that read one x: its attribute modules), the node producing the module's input y:
  MatMul(x, W^T)                        W^T an initializer [in, out]: float32, float16 or
                                        bfloat16, memory-mapped from the external data file
  com.microsoft.MatMulNBits(x, B, scales[, zero_points])
                                        W[n, k] = (code - zero point) * scale of k's block
                                        (4 or 8 bits; zero points packed uint8, float, or
                                        absent: 2^(bits - 1)), dequantized row by row
  ort_lora.QuantMatMul(x, tiles, tile_scales[, tile_zeros][, tile_offsets])
                                        4- or 8-bit blocks in 64-column tiles
                                        (quant_tiles.py), read a tile at a time; output i of
                                        one with splits: rows from sum(splits[:i]) on
  Add(MatMulNBits(...), MatMul(block sums of x, offsets^T))
                                        the same plus each block's float offset (GGUF Q4_1
                                        mapped exactly, export/quant_graph.py)
  Split(one of the above, sizes)        weights stacked by rows (q/k/v, gate/up of a
                                        quantized export): output i is rows
                                        [sum(sizes[:i]), sum(sizes[:i + 1])) of the stack
Anything else (a bias added before LoraSGMV, other quantized forms) cannot be read back: rows()
raises an AdapterError that names the module, the layer and the producer. Only the rows asked
for are read (memory-mapped pages), so a module's weight is never materialized whole.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ort_lora.adapters.errors import AdapterError
from ort_lora.bfloat16 import bfloat16_bits_to_float32
from ort_lora.contract import MODEL_NAME, OPS_DOMAIN, lora_sgmv_module_inputs
from ort_lora.quant_tiles import TILE, TiledBlocks, dequantize

MSFT = "com.microsoft"
# ONNX TensorProto element type -> numpy dtype of the stored bytes (bfloat16: uint16 bits)
_STORED = {1: np.float32, 10: np.float16, 16: np.uint16, 2: np.uint8, 7: np.int64}
_A_OFFSETS = re.compile(r"lora_(?P<module>\w+)_a_offsets")


class BaseWeights(Protocol):
    """Where DoRA reads base weights: rows [start, stop) of W [out, in] of (layer, module) as
    float64 [stop - start, in]; AdapterError when they cannot be had."""

    def rows(self, layer: int, module: str, start: int, stop: int) -> np.ndarray: ...


@dataclass
class _Dense:
    wt: np.ndarray  # [in, out] as stored (float32 / float16 / uint16 bfloat16 bits)
    bfloat16: bool

    def rows(self, start: int, stop: int) -> np.ndarray:
        block = np.asarray(self.wt[:, start:stop])  # [in, n], read from the mapped pages
        if self.bfloat16:
            block = bfloat16_bits_to_float32(block)
        return block.T.astype(np.float64)  # [n, in]


@dataclass
class _NBits:
    """com.microsoft.MatMulNBits weights: codes [N, k_blocks, blob] uint8, per block scales
    and zero points, K and N, plus an optional offset per block (offsets_t [k_blocks, N])."""

    codes: np.ndarray
    scales: np.ndarray  # float [N * k_blocks]
    zero_points: np.ndarray | None  # packed uint8 [N, ...] or float [N * k_blocks]
    bits: int
    block_size: int
    k: int
    n: int
    offsets_t: np.ndarray | None = None

    def rows(self, start: int, stop: int) -> np.ndarray:
        n, k_blocks = stop - start, self.codes.shape[1]
        packed = np.asarray(self.codes[start:stop]).reshape(n, -1)  # [n, k_blocks * blob]
        codes = _unpack(packed, self.bits)[:, : k_blocks * self.block_size]  # [n, padded K]
        scales = np.asarray(self.scales).reshape(self.n, k_blocks)[start:stop]  # [n, k_blocks]
        zp = self._zero_points(start, stop, k_blocks)  # [n, k_blocks]
        blocks = codes.reshape(n, k_blocks, self.block_size).astype(np.float64)
        w = (blocks - zp[..., None]) * scales.astype(np.float64)[..., None]
        if self.offsets_t is not None:
            w += np.asarray(self.offsets_t[:, start:stop]).T.astype(np.float64)[..., None]
        return w.reshape(n, -1)[:, : self.k]  # [n, K]

    def _zero_points(self, start: int, stop: int, k_blocks: int) -> np.ndarray:
        if self.zero_points is None:
            return np.full((stop - start, k_blocks), 2.0 ** (self.bits - 1))
        if self.zero_points.dtype != np.uint8:  # float zero points, one per block
            return np.asarray(self.zero_points).reshape(self.n, k_blocks)[start:stop]
        packed = np.asarray(self.zero_points).reshape(self.n, -1)[start:stop]
        return _unpack(packed, self.bits)[:, :k_blocks].astype(np.float64)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [n, m] -> codes [n, m * 8 / bits], the low bits of each byte first."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [n, m, per_byte]
    return codes.reshape(packed.shape[0], -1)


@dataclass
class _Tiled:
    """ort_lora.QuantMatMul weights: TiledBlocks of a weight with n rows (quant_tiles.py)."""

    tiled: TiledBlocks
    n: int

    def rows(self, start: int, stop: int) -> np.ndarray:
        first, last = start // TILE, -(-stop // TILE)
        t = self.tiled
        arrays = (t.codes, t.scales, t.zeros, t.offsets)
        picked = [None if a is None else np.asarray(a[first:last]) for a in arrays]
        w = dequantize(TiledBlocks(*picked, bits=t.bits), min(self.n, last * TILE) - first * TILE)
        lo = start - first * TILE
        return w[lo : lo + stop - start]


@dataclass
class _Rows:
    """Rows [start, ...) of another source's weight: one part of weights stacked by rows."""

    source: _Dense | _NBits | _Tiled
    start: int

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.source.rows(self.start + start, self.start + stop)


class ExportedWeights:
    """BaseWeights of an exported model directory (see the module docstring). The graph is
    indexed on first use (thread-safe); rows() may be called from any thread."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._sources: dict[tuple[int, str], _Dense | _NBits | _Rows | str] | None = None

    def rows(self, layer: int, module: str, start: int, stop: int) -> np.ndarray:
        source = self._index().get((layer, module))
        if source is None:
            raise AdapterError(
                f"the exported {MODEL_NAME}: no LoraSGMV node for {module} in layer {layer}"
            )
        if isinstance(source, str):
            raise AdapterError(
                f"the base weight of {module} in layer {layer} cannot be read back from "
                f"the exported {MODEL_NAME}: {source}"
            )
        return source.rows(start, stop)

    def _index(self) -> dict:
        with self._lock:
            if self._sources is None:
                self._sources = _GraphIndex(self.model_dir).sources()
            return self._sources


def _module_inputs(inputs, modules: int) -> list[tuple[str, str]]:
    """(y, a_offsets) of each module of a LoraSGMV node (the op's attribute modules)."""
    at = [lora_sgmv_module_inputs(m) for m in range(modules)]
    return [(inputs[y], inputs[a]) for y, a in at if a < len(inputs)]


class _GraphIndex:
    """One pass over model.onnx (external data left on disk): each LoraSGMV node's weights."""

    def __init__(self, model_dir: Path):
        import onnx

        self.model_dir = model_dir.resolve()
        path = self.model_dir / MODEL_NAME
        try:
            graph = onnx.load(str(path), load_external_data=False).graph
        except Exception as e:  # a missing or unreadable file, a protobuf decode error
            # the model directory is the server's: neither it nor onnx's message is shown
            raise AdapterError(
                f"cannot read the exported {MODEL_NAME} for DoRA's base weights "
                f"({type(e).__name__})"
            ) from None
        self.nodes = list(graph.node)
        self.producer = {out: node for node in self.nodes for out in node.output}
        self.inits = {t.name: t for t in graph.initializer}

    def sources(self) -> dict[tuple[int, str], _Dense | _NBits | _Rows | str]:
        out = {}
        for node in self.nodes:
            if node.op_type != "LoraSGMV" or node.domain != OPS_DOMAIN or len(node.input) < 7:
                continue
            attrs = {a.name: a.i for a in node.attribute}
            for y, a_offsets in _module_inputs(node.input, attrs.get("modules", 1)):
                match = _A_OFFSETS.fullmatch(a_offsets)
                if match and "layer" in attrs:
                    out[attrs["layer"], match["module"]] = self._source(y)
        return out

    def _source(self, y: str) -> _Dense | _NBits | _Tiled | _Rows | str:
        """How the weight behind base projection y is read, or why it cannot be."""
        node = self.producer.get(y)
        if node is None:
            return f"its input {y!r} is no node's output"
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            return self._dense(node)
        if node.op_type == "MatMulNBits" and node.domain == MSFT:
            return self._nbits(node)
        if node.op_type == "QuantMatMul" and node.domain == OPS_DOMAIN:
            tiled = self._tiled(node)
            splits = next((list(a.ints) for a in node.attribute if a.name == "splits"), [])
            out = list(node.output).index(y)
            return tiled if isinstance(tiled, str) or not out else _Rows(tiled, sum(splits[:out]))
        if node.op_type == "Add" and node.domain in ("", "ai.onnx"):
            return self._with_offsets(node)
        if node.op_type == "Split" and node.domain in ("", "ai.onnx"):
            return self._split_part(node, y)
        return f"it is produced by a {node.domain or 'ai.onnx'}.{node.op_type} node ({node.name})"

    def _dense(self, node) -> _Dense | str:
        t = self.inits.get(node.input[1])
        if t is None or len(t.dims) != 2 or t.data_type not in (1, 10, 16):
            return f"MatMul {node.name} does not multiply by a float [in, out] initializer"
        return _Dense(self._array(t), bfloat16=t.data_type == 16)

    def _nbits(self, node) -> _NBits | str:
        attrs = {a.name: a.i for a in node.attribute}
        bits, block = attrs.get("bits", 4), attrs.get("block_size", 0)
        if any(node.input[4:]):
            return f"MatMulNBits {node.name} has a g_idx or bias input"
        if bits not in (4, 8) or block < 16 or block & (block - 1):
            return f"MatMulNBits {node.name} has bits={bits}, block_size={block}"
        names = [*node.input[1:4], "", ""][:3]  # B, scales, zero_points ("" if absent)
        tensors = [self.inits.get(name) if name else None for name in names]
        if tensors[0] is None or tensors[1] is None or (names[2] and tensors[2] is None):
            return f"MatMulNBits {node.name} reads weights that are not initializers"
        codes, scales = self._array(tensors[0]), self._array(tensors[1])
        zero_points = None if tensors[2] is None else self._array(tensors[2])
        return _NBits(codes, scales, zero_points, bits, block, attrs["K"], attrs["N"])

    def _tiled(self, node) -> _Tiled | str:
        names = [*node.input[1:5], "", "", ""][:4]  # tiles, scales, zeros, offsets
        tensors = [self.inits.get(name) if name else None for name in names]
        if any(name and t is None for name, t in zip(names, tensors)):
            return f"QuantMatMul {node.name} reads weights that are not initializers"
        arrays = [None if t is None else self._array(t) for t in tensors]
        attrs = {a.name: a.i for a in node.attribute}
        if attrs.get("bits", 4) not in (4, 8):
            return f"QuantMatMul {node.name} has bits={attrs['bits']}"
        return _Tiled(TiledBlocks(*arrays, bits=attrs.get("bits", 4)), attrs["N"])

    def _with_offsets(self, node) -> _NBits | str:
        """Add(MatMulNBits(x), MatMul(block sums of x, offsets_t)): the offset branch."""
        if any(name in self.inits for name in node.input):
            return "its bias is added before LoraSGMV (exported before DoRA support: re-export)"
        producers = sorted((self.producer.get(name) for name in node.input), key=_is_nbits)
        extra, nbits = producers if len(producers) == 2 else (None, None)
        if extra is None or not _is_nbits(nbits):
            return f"Add {node.name} is not a MatMulNBits with its offset branch"
        weights = self._nbits(nbits)
        offsets = self.inits.get(extra.input[1]) if extra.op_type == "MatMul" else None
        if isinstance(weights, str) or offsets is None:
            return weights if isinstance(weights, str) else f"Add {node.name}: no offsets"
        weights.offsets_t = self._array(offsets)  # [k_blocks, N]
        return weights

    def _split_part(self, node, y: str) -> _Rows | str:
        """Output y of Split(stacked projection, sizes) along the rows of the stack's weight."""
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        sizes = self.inits.get(node.input[1]) if len(node.input) > 1 else None
        if axis not in (1, -1) or sizes is None:
            return f"Split {node.name} does not split the output's last axis by given sizes"
        stacked = self._source(node.input[0])
        if isinstance(stacked, str):
            return stacked
        start = int(np.sum(self._array(sizes)[: list(node.output).index(y)]))
        return _Rows(stacked, start)

    def _array(self, t) -> np.ndarray:
        """The initializer as stored: memory-mapped when it lives in external data."""
        from onnx import TensorProto, numpy_helper

        if t.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(t) if t.data_type != 16 else _raw(t)
        info = {e.key: e.value for e in t.external_data}
        path = (self.model_dir / info["location"]).resolve()
        if not path.is_relative_to(self.model_dir) or not path.is_file():
            raise AdapterError(
                f"initializer {t.name}: external data {info['location']!r} is not in the model"
            )
        dtype = np.dtype(_STORED[t.data_type])
        offset, shape = int(info.get("offset", 0)), tuple(t.dims)
        length = int(np.prod(shape)) * dtype.itemsize
        if int(info.get("length", length)) != length or offset + length > path.stat().st_size:
            raise AdapterError(
                f"initializer {t.name}: external data out of {info['location']!r}'s bounds"
            )
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def _is_nbits(node) -> bool:
    return node is not None and node.op_type == "MatMulNBits" and node.domain == MSFT


def _raw(t) -> np.ndarray:
    """An inline bfloat16 initializer's bits (uint16)."""
    return np.frombuffer(t.raw_data, np.uint16).reshape(tuple(t.dims))
