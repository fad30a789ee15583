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

Where float16 holds them exactly (4 bits, no zero points: a GGUF file's Q4_0 / Q4_1 blocks,
whose d and m are float16), scales are stored in float16 and offsets as float16 minimums m, the
weights at code 0, with offset = m + 8 * scale in float32: 0.625 bytes a weight instead of 0.75
for the same W, and QuantMatMul computes the same y bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TILE = 64  # columns per tile


@dataclass(frozen=True)
class TiledBlocks:
    codes: np.ndarray  # uint8 [tiles, K / block, block * bits / 32, 4 * TILE]
    scales: np.ndarray  # float32 (or float16) [tiles, K / block, TILE]
    zeros: np.ndarray | None  # uint8 [tiles, K / block, TILE]; None: 2 ** (bits - 1)
    offsets: np.ndarray | None  # float32 (float16: minimums) [tiles, K / block, TILE]; None: 0
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
    scales, offsets = per_column(scales, np.float32), per_column(offsets, np.float32)
    if bits == 4 and zeros is None:
        scales, offsets = _in_float16(scales, offsets) or (scales, offsets)
    return TiledBlocks(
        codes=np.ascontiguousarray(packed.reshape(tiles, blocks, chunks, 4 * TILE)),
        scales=scales,
        zeros=per_column(zeros, np.uint8),
        offsets=offsets,
        bits=bits,
    )


def _in_float16(scales: np.ndarray, offsets: np.ndarray | None) -> tuple | None:
    """(float16 scales, float16 minimums or None) that give exactly these float32 scales and
    offsets (offset = minimum + 8 * scale, rounded once to float32), or None."""
    with np.errstate(over="ignore", invalid="ignore"):
        half = scales.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), scales):
            return None
        if offsets is None:
            return half, None
        minimums = (offsets - np.float32(8) * scales).astype(np.float16)
        if not np.array_equal(offsets_of(half, minimums), offsets):
            return None
    return half, minimums


def offsets_of(scales: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    """The float32 offsets of float16 scales d and minimums m (a GGUF Q4_1 block's): m + 8 d,
    rounded once, as QuantMatMul forms them from float16 tiles."""
    return minimums.astype(np.float32) + np.float32(8) * scales.astype(np.float32)


def untile(t: TiledBlocks, n: int) -> tuple:
    """tile's inverse for the first n columns: (codes uint8 [n, K], scales, zeros or None,
    offsets or None [n, K / block], scales and offsets float32) and the block size."""
    tiles, blocks, chunks, _ = t.codes.shape
    b = t.codes.reshape(tiles, blocks, chunks, TILE, 4).transpose(0, 3, 1, 2, 4)
    if t.bits == 4:
        b = np.stack([b & 0x0F, b >> 4], axis=-2)  # [tiles, column, block, chunk, 2, 4]
    codes = b.reshape(tiles * TILE, blocks * t.block_size)[:n]

    def per_row(a):
        if a is None:
            return None
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, blocks)[:n])

    scales, offsets = t.scales, t.offsets
    if scales.dtype == np.float16:
        offsets = None if offsets is None else offsets_of(scales, offsets)
        scales = scales.astype(np.float32)
    return codes, per_row(scales), per_row(t.zeros), per_row(offsets), t.block_size


def dequantize(t: TiledBlocks, n: int) -> np.ndarray:
    """W [n, K] as float64: the first n columns' weights."""
    codes, scales, zeros, offsets, block = untile(t, n)
    blocks = codes.reshape(n, -1, block).astype(np.float64)
    zero = 2.0 ** (t.bits - 1) if zeros is None else zeros[..., None].astype(np.float64)
    w = (blocks - zero) * scales[..., None].astype(np.float64)
    if offsets is not None:
        w += offsets[..., None].astype(np.float64)
    return w.reshape(n, -1)
