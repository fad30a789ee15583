"""GGUF tensors as stored (GGML block types), mapped onto MatMulNBits blocks without
dequantizing and requantizing where the formats allow.

GGML block layouts (32 values a block, little endian; d, m float16):
    Q4_0  d, 16 bytes of nibbles      w = d * (q - 8)      q in 0..15
    Q4_1  d, m, 16 bytes of nibbles   w = d * q + m        q in 0..15
    Q8_0  d, 32 int8                  w = d * q            q in -128..127
In a block's 16 nibble bytes, byte j holds value j (low nibble) and value j + 16 (high).

Onto MatMulNBits (quant.py), scale d as float32, codes repacked, no value changed:
    Q4_0 -> int4: code q (zero point 8, the op's default)      -> int8: code q + 120
    Q8_0 -> int8: code q + 128 (zero point 128)                 (int4: not representable)
    Q4_1 -> the Q4_0 codes and scale plus a per-block float offset m + 8 d, exact
            ("offset", added by quant_graph.py); or, with integer zero points only,
            zero point round(-m / d) (int4: clamped to 0..15), which moves every value of the
            block by the rounding ("zero_point": the manifest records the difference).
Anything else (other types, other block sizes, Q8_0 -> int4) returns None: the caller
quantizes the dequantized tensor instead.
"""

from __future__ import annotations

import numpy as np

from ort_lora.export.quant import BlockQuantized, pack_codes
from ort_lora.quant_tiles import offsets_of

GGUF_BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
Q4_1_MODES = ("offset", "zero_point")


def map_blocks(
    raw: np.ndarray, ggml_type: str, bits: int, block_size: int, q4_1: str = "offset"
) -> BlockQuantized | None:
    """GGML rows raw uint8 [N, K / 32 * block bytes] as MatMulNBits blocks of `bits`, or
    None when this type cannot be carried over as it is (see the module docstring)."""
    if ggml_type not in BLOCK_BYTES or block_size != GGUF_BLOCK:
        return None
    if ggml_type == "Q8_0" and bits != 8:
        return None
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[ggml_type])  # [N, K / 32, bytes]
    d = _f16(blocks[..., 0:2])  # [N, K / 32]
    if ggml_type == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # [N, K / 32, 32]
        return _blocks(q, 8, d, None, None, "gguf Q8_0")
    nibbles = blocks[..., 4:] if ggml_type == "Q4_1" else blocks[..., 2:]  # [N, K / 32, 16]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int16)
    widen = 0 if bits == 4 else 120  # int8 codes keep q - 8 around the op's zero point 128
    if ggml_type == "Q4_0":
        return _blocks(q + widen, bits, d, None, None, "gguf Q4_0")
    m = _f16(blocks[..., 2:4])
    if q4_1 == "offset":
        return _blocks(q + widen, bits, d, None, offsets_of(d, m), "gguf Q4_1 (offset)")
    assert q4_1 == "zero_point", q4_1
    safe = np.where(d == 0, np.float32(1), d)
    zeros = np.clip(np.rint(-m / safe) + widen, 0, 2**bits - 1).astype(np.uint8)
    return _blocks(q + widen, bits, d, zeros, None, "gguf Q4_1 (zero point)")


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _blocks(q, bits, scales, zeros, offsets, method) -> BlockQuantized:
    n, blocks, size = q.shape
    codes = pack_codes(q.reshape(n, blocks * size).astype(np.uint8), bits, size)
    return BlockQuantized(bits, size, codes, scales, zeros, offsets, method)


def dequantizable(ggml_type) -> bool:
    """Whether the gguf package can dequantize tensors of this GGMLQuantizationType."""
    from gguf import GGML_QUANT_SIZES, quants

    block, size = GGML_QUANT_SIZES[ggml_type]
    try:
        quants.dequantize(np.zeros((1, size), dtype=np.uint8), ggml_type)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


class GGUFTensors:
    """The stored tensors of one GGUF file by Hugging Face name, rows in transformers' order.

    transformers names GGUF tensors and undoes llama.cpp's q/k row permutation while it
    dequantizes; the same row order is applied here to the raw block rows, found by running
    its tensor processor on the row indices (a processor that does more than permute rows
    leaves that tensor unmapped)."""

    def __init__(self, path, model):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.reader = GGUFReader(str(path))
        arch = bytes(self.reader.fields["general.architecture"].parts[-1]).decode()
        config = model.config.to_dict()
        self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
        to_hf = get_gguf_hf_weights_map(model, self._processor)
        self._tensors = {to_hf[t.name]: t for t in self.reader.tensors if t.name in to_hf}

    def ggml_type(self, hf_name: str) -> str | None:
        """The GGML type name of tensor `hf_name`, or None if the file has no such tensor."""
        tensor = self._tensors.get(hf_name)
        return None if tensor is None else tensor.tensor_type.name

    def raw_rows(self, hf_name: str) -> np.ndarray | None:
        """The stored block rows uint8 [N, bytes per row] of a 2-D tensor in transformers' row
        order, or None when its GGUF form is not a row permutation of it."""
        tensor = self._tensors.get(hf_name)
        if tensor is None or tensor.data.ndim != 2:
            return None
        n = tensor.data.shape[0]
        index = np.arange(n, dtype=np.float64).reshape(n, 1)
        kwargs = dict(tensor_key_mapping={}, parsed_parameters={"tensors": {}})
        result = self._processor.process(weights=index, name=tensor.name, **kwargs)
        order = np.asarray(result.weights).reshape(-1)
        if result.name != tensor.name or not np.array_equal(np.sort(order), np.arange(n)):
            return None
        return np.asarray(tensor.data)[order.astype(np.int64)]
