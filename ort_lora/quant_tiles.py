"""The weight layout of ort_lora.QuantMatMul (custom_ops/quant_matmul/quant_matmul_cpu.h): 4- or
8-bit block-quantized W [N, K] in tiles of 64 columns, for int8 dot products. Numpy only; shared
by the exporter (export/quant.py writes it) and DoRA's base-weight reader
(adapters/base_weights.py reads it back), so neither imports the other.

N is cut into tiles of TILE columns (the last padded with zero codes and scales), K into blocks
of `block_size`, a block into chunks of 4 * TILE bytes: 4 bytes per column c at 4c..4c+3.
4 bits: chunk j holds the 8 values of k from b * block_size + 8 j, byte i holding k + i in its
low nibble and k + 4 + i in its high one. 8 bits: chunk j holds the 4 values of k from
b * block_size + 4 j, byte i holding k + i. Either way a 64-byte line is 16 columns' codes for
one AVX-512 register. Per column and block: scale, zero point (absent: 2 ** (bits - 1)) and
offset (absent: 0); W[n, k] = (code - zero) * scale + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 64  # columns per tile


@dataclass(frozen=True)
class TiledBlocks:
    codes: np.ndarray  # uint8 [tiles, K / block, block * bits / 32, 4 * TILE]
    scales: np.ndarray  # float32 [tiles, K / block, TILE]
    zeros: np.ndarray | None  # uint8 [tiles, K / block, TILE]; None: 2 ** (bits - 1)
    offsets: np.ndarray | None  # float32 [tiles, K / block, TILE]; None: 0
    bits: int = 4  # the codes' width: 4 or 8

    @property
    def block_size(self) -> int:
        return self.codes.shape[2] * 32 // self.bits


def tile(codes, scales, zeros, offsets, block_size: int, bits: int = 4) -> TiledBlocks:
    """Codes uint8 [N, K] (each < 2 ** bits) and per-block scales / zeros / offsets [N, K / block]
    (zeros, offsets may be None) in the tiled layout."""
    assert bits in (4, 8), bits
    n, k = codes.shape
    tiles, blocks = -(-n // TILE), k // block_size
    padded = np.zeros((tiles * TILE, k), np.uint8)
    padded[:n] = codes
    if bits == 8:  # [tiles, column, block, chunk, i] -> bytes [tiles, block, chunk, column, i]
        packed = padded.reshape(tiles, TILE, blocks, block_size // 4, 4).transpose(0, 2, 3, 1, 4)
    else:  # [tiles, column, block, chunk, low/high, i] -> bytes [tiles, block, chunk, column, i]
        c = padded.reshape(tiles, TILE, blocks, block_size // 8, 2, 4)
        packed = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)

    def per_column(a, dtype):
        if a is None:
            return None
        out = np.zeros((tiles * TILE, blocks), dtype)
        out[:n] = a
        return np.ascontiguousarray(out.reshape(tiles, TILE, blocks).transpose(0, 2, 1))

    chunks = block_size * bits // 32
    return TiledBlocks(
        codes=np.ascontiguousarray(packed.reshape(tiles, blocks, chunks, 4 * TILE)),
        scales=per_column(scales, np.float32),
        zeros=per_column(zeros, np.uint8),
        offsets=per_column(offsets, np.float32),
        bits=bits,
    )


def untile(t: TiledBlocks, n: int) -> tuple:
    """tile's inverse for the first n columns: (codes uint8 [n, K], scales, zeros or None,
    offsets or None [n, K / block]) and the block size."""
    tiles, blocks, chunks, _ = t.codes.shape
    b = t.codes.reshape(tiles, blocks, chunks, TILE, 4).transpose(0, 3, 1, 2, 4)
    if t.bits == 4:
        b = np.stack([b & 0x0F, b >> 4], axis=-2)  # [tiles, column, block, chunk, 2, 4]
    codes = b.reshape(tiles * TILE, blocks * t.block_size)[:n]

    def per_row(a):
        if a is None:
            return None
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, blocks)[:n])

    return codes, per_row(t.scales), per_row(t.zeros), per_row(t.offsets), t.block_size


def dequantize(t: TiledBlocks, n: int) -> np.ndarray:
    """W [n, K] as float64: the first n columns' weights."""
    codes, scales, zeros, offsets, block = untile(t, n)
    blocks = codes.reshape(n, -1, block).astype(np.float64)
    zero = 2.0 ** (t.bits - 1) if zeros is None else zeros[..., None].astype(np.float64)
    w = (blocks - zero) * scales[..., None].astype(np.float64)
    if offsets is not None:
        w += offsets[..., None].astype(np.float64)
    return w.reshape(n, -1)
