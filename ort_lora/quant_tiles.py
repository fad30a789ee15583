"""The weight layout of ort_lora.QuantMatMul (custom_ops/quant_matmul/quant_matmul_cpu.h): 4-bit
block-quantized W [N, K] in tiles of 64 columns, for int8 dot products. Numpy only; shared by
the exporter (export/quant.py writes it) and DoRA's base-weight reader (adapters/base_weights.py
reads it back), so neither imports the other.

N is cut into tiles of TILE columns (the last padded with zero codes and scales), K into blocks
of `block_size`. Tile t, block b, chunk j (8 values of k from b * block_size + 8 j): 4 bytes per
column c at 4c..4c+3, byte i holding k + i in its low nibble and k + 4 + i in its high one; so a
64-byte line is 16 columns' codes for one AVX-512 register. Per column and block: scale, zero
point (absent: 8) and offset (absent: 0); W[n, k] = (code - zero) * scale + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 64  # columns per tile


@dataclass(frozen=True)
class TiledBlocks:
    codes: np.ndarray  # uint8 [tiles, K / block, block / 8, 4 * TILE]
    scales: np.ndarray  # float32 [tiles, K / block, TILE]
    zeros: np.ndarray | None  # uint8 [tiles, K / block, TILE]; None: 8
    offsets: np.ndarray | None  # float32 [tiles, K / block, TILE]; None: 0


def tile(codes, scales, zeros, offsets, block_size: int) -> TiledBlocks:
    """Codes uint8 [N, K] (each < 16) and per-block scales / zeros / offsets [N, K / block]
    (zeros, offsets may be None) in the tiled layout."""
    n, k = codes.shape
    tiles, blocks = -(-n // TILE), k // block_size
    padded = np.zeros((tiles * TILE, k), np.uint8)
    padded[:n] = codes
    # [tiles, column, block, chunk, low/high, i] -> bytes [tiles, block, chunk, column, i]
    c = padded.reshape(tiles, TILE, blocks, block_size // 8, 2, 4)
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4)

    def per_column(a, dtype):
        if a is None:
            return None
        out = np.zeros((tiles * TILE, blocks), dtype)
        out[:n] = a
        return np.ascontiguousarray(out.reshape(tiles, TILE, blocks).transpose(0, 2, 1))

    return TiledBlocks(
        codes=np.ascontiguousarray(packed.reshape(tiles, blocks, block_size // 8, 4 * TILE)),
        scales=per_column(scales, np.float32),
        zeros=per_column(zeros, np.uint8),
        offsets=per_column(offsets, np.float32),
    )


def untile(t: TiledBlocks, n: int) -> tuple:
    """tile's inverse for the first n columns: (codes uint8 [n, K], scales, zeros or None,
    offsets or None [n, K / block]) and the block size."""
    tiles, blocks, chunks, _ = t.codes.shape
    b = t.codes.reshape(tiles, blocks, chunks, TILE, 4).transpose(0, 3, 1, 2, 4)
    codes = np.stack([b & 0x0F, b >> 4], axis=-2)  # [tiles, column, block, chunk, 2, 4]
    codes = codes.reshape(tiles * TILE, blocks * 8 * chunks)[:n]

    def per_row(a):
        if a is None:
            return None
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, blocks)[:n])

    return codes, per_row(t.scales), per_row(t.zeros), per_row(t.offsets), 8 * chunks


def dequantize(t: TiledBlocks, n: int) -> np.ndarray:
    """W [n, K] as float64: the first n columns' weights."""
    codes, scales, zeros, offsets, block = untile(t, n)
    blocks = codes.reshape(n, -1, block).astype(np.float64)
    zero = 8.0 if zeros is None else zeros[..., None].astype(np.float64)
    w = (blocks - zero) * scales[..., None].astype(np.float64)
    if offsets is not None:
        w += offsets[..., None].astype(np.float64)
    return w.reshape(n, -1)
