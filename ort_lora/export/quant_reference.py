"""The transformers reference of a quantized export: the same model on the numbers the export
holds, read back from its model.onnx, so --verify and the tests compare like with like.

- weights: every MatMulNBits / QuantMatMul / GatherBlockQuantized weight of the graph (stacked
  ones split back into their parts), dequantized
  (quant.py's BlockQuantized.dequantize, checked against ORT's own kernel in the tests), is
  loaded into the transformers model in place of the checkpoint's tensor (fused modules: the
  parts concatenated back).
- activations (accuracy_level 4, emulate=True): MatMulNBits quantizes its float input to int8
  per block before it multiplies (quant.quantize_activations); each quantized nn.Linear of the
  reference does the same to its input. Exact while both sides round every input alike: one
  input that float32 summation order tips over a rounding boundary changes what follows
  (tolerances: tests/quant_cases.py; a deep model diverges, so --verify does not emulate).
  A per-block offset (GGUF Q4_1 mapped exactly) multiplies the unquantized input, as the
  graph's offset branch does. PEFT's LoRA layers call the wrapped base layer, so their own
  A / B still see the float input, as LoraSGMV does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ort_lora.export.quant import BlockQuantized, quantize_activations, untile_blocks
from ort_lora.export.quant_graph import QUANT, stacked_parts
from ort_lora.quant_tiles import TiledBlocks


def exported_weights(model_dir) -> dict[str, BlockQuantized]:
    """Checkpoint tensor name -> its blocks, read from model_dir/model.onnx."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(Path(model_dir) / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in model.graph.initializer}

    def array(name):
        return numpy_helper.to_array(inits[name]) if name in inits else None

    out = {}
    for node in model.graph.node:
        if node.op_type not in ("MatMulNBits", "GatherBlockQuantized", "QuantMatMul"):
            continue
        data = node.input[0 if node.op_type == "GatherBlockQuantized" else 1]
        attrs = {a.name: a.i for a in node.attribute}
        weight = data.rsplit(QUANT, 1)[0]
        if node.op_type == "QuantMatMul":  # ort_lora's op: tiles (quant.tile_blocks)
            fields = ("tiles", "tile_scales", "tile_zeros", "tile_offsets")
            arrays = (array(f"{weight}{QUANT}{f}") for f in fields)
            tiled = TiledBlocks(*arrays, bits=attrs.get("bits", 4))
            splits = next((list(a.ints) for a in node.attribute if a.name == "splits"), None)
            out.update(_parts(weight, untile_blocks(tiled, attrs["N"]), array, splits))
            continue
        scales = array(f"{weight}{QUANT}scales")
        zeros = array(f"{weight}{QUANT}zero_points")
        offsets_t = array(f"{weight}{QUANT}offsets_T")
        blocks = BlockQuantized(
            bits=attrs["bits"],
            block_size=attrs["block_size"],
            codes=array(data).reshape(*scales.shape, -1),  # the gather's [V, H * bits / 8] too
            scales=scales,
            zeros=None if zeros is None else _unpack_zeros(zeros, scales.shape, attrs["bits"]),
            offsets=None if offsets_t is None else np.ascontiguousarray(offsets_t.T),
            method="exported",
        )
        out.update(_parts(weight, blocks, array))
    return out


def _parts(weight: str, blocks: BlockQuantized, array, rows=None) -> dict[str, BlockQuantized]:
    """{weight: blocks}, or each part's rows of a stacked weight (`rows`: the node's own split
    sizes; else those of the Split after it)."""
    parts = stacked_parts(weight)
    if len(parts) == 1:
        return {weight: blocks}
    starts = np.cumsum([0, *(rows or array(f"{weight}{QUANT}rows"))])
    return {p: blocks.rows(slice(a, b)) for p, a, b in zip(parts, starts, starts[1:])}


def _unpack_zeros(packed: np.ndarray, shape: tuple[int, int], bits: int) -> np.ndarray:
    n, blocks = shape
    if bits == 8:
        return packed.reshape(n, blocks)
    rows = packed.reshape(n, -1)
    both = np.stack([rows & 0x0F, rows >> 4], axis=-1).reshape(n, -1)
    return np.ascontiguousarray(both[:, :blocks])


def use_exported_weights(reference, model_dir, manifest, emulate: bool = True) -> None:
    """Make the transformers model `reference` compute what the export in model_dir computes
    (see the module docstring); emulate=False: its weights only, float inputs. A float export
    leaves it as it is."""
    q = manifest.quantization
    if not q:
        return
    weights = exported_weights(model_dir)
    emulate = emulate and q["accuracy_level"] == 4
    for name, parts in _by_parameter(weights, manifest.fused_modules).items():
        module = reference.get_submodule(name.rsplit(".", 1)[0])
        _load(module, [weights[p] for p in parts], emulate)
    tied = "model.embed_tokens.weight"
    if tied in weights and "lm_head.weight" not in weights:  # the head multiplies by it too
        _load(reference.get_output_embeddings(), [weights[tied]], emulate)


def _by_parameter(weights: dict, fused: dict) -> dict[str, list[str]]:
    """Reference parameter name -> the exported weights that make it up, in row order."""
    out = {}
    for name in weights:
        out[name] = [name]
    for fused_name, parts in fused.items():
        for name in list(out):
            prefix, _, rest = name.rpartition(f".{parts[0]}.")
            if prefix and rest == "weight":
                out[f"{prefix}.{fused_name}.weight"] = [f"{prefix}.{p}.weight" for p in parts]
                for p in parts:
                    out.pop(f"{prefix}.{p}.weight")
    return out


def _load(module, parts: list[BlockQuantized], emulate: bool) -> None:
    import torch

    full = np.concatenate([p.dequantize() for p in parts])  # [out, in]
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(full))
    if not emulate or not isinstance(module, torch.nn.Linear):
        return  # the embedding (a gather) and accuracy levels 0 / 1 see float inputs
    has_offsets = any(p.offsets is not None for p in parts)
    offsets = np.concatenate([_expanded_offsets(p) for p in parts]) if has_offsets else None
    base = torch.from_numpy(full - offsets) if has_offsets else module.weight.detach()
    off = None if offsets is None else torch.from_numpy(offsets)
    block = parts[0].block_size

    def forward(x):
        xq = torch.from_numpy(quantize_activations(x.detach().numpy(), block))
        y = torch.nn.functional.linear(xq, base, module.bias)
        return y if off is None else y + torch.nn.functional.linear(x, off)

    module.forward = forward


def _expanded_offsets(q: BlockQuantized) -> np.ndarray:
    """The per-block offsets of q as a full [N, K] matrix (zeros without offsets)."""
    n, k = q.shape
    if q.offsets is None:
        return np.zeros((n, k), dtype=np.float32)
    return np.repeat(q.offsets, q.block_size, axis=1).astype(np.float32)
