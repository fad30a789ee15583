"""Block-quantized weights in the layout of ONNX Runtime's com.microsoft.MatMulNBits.

A weight W [N, K] (a linear layer's [out, in]) is cut along K into blocks of `block_size`
values. Each block has a float scale and a zero point; each value a `bits`-wide code:

    W[n, k] = (code[n, k] - zero[n, b]) * scale[n, b]  (+ offset[n, b])      b = k // block_size

MatMulNBits stores codes packed low bits first along K: `codes` uint8 [N, K / block, block *
bits / 8] (4 bits: value 2j in the low nibble of byte j, 2j + 1 in the high one). A missing
zero-point input means 2 ** (bits - 1) (8 for int4, 128 for int8), the fastest kernels.

`offset` is not part of MatMulNBits: it holds GGUF Q4_1's per-block float minimum exactly
(w = d * q + m = d * (q - 8) + (m + 8 d)), which the op's integer zero points cannot. The
graph adds it as blocksum(x) @ offset^T (quant_graph.py). Everything here is numpy, no ORT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ort_lora import quant_tiles
from ort_lora.export.errors import ExportError
from ort_lora.quant_tiles import TiledBlocks

BITS = (4, 8)
# MatMulNBits needs a power of two >= 16 (ORT checks it when it builds the kernel)
MIN_BLOCK_SIZE = 16


@dataclass(frozen=True)
class BlockQuantized:
    """W [N, K] as MatMulNBits blocks (see the module docstring)."""

    bits: int
    block_size: int
    codes: np.ndarray  # uint8 [N, K / block_size, block_size * bits / 8]
    scales: np.ndarray  # float32 [N, K / block_size]
    zeros: np.ndarray | None  # uint8 [N, K / block_size] unpacked; None: 2 ** (bits - 1)
    offsets: np.ndarray | None  # float32 [N, K / block_size] added to every value; None: 0
    method: str  # how the blocks were made: "rtn", "gguf Q4_0", ...

    def __post_init__(self):
        n, blocks = self.scales.shape
        assert self.codes.shape == (n, blocks, self.block_size * self.bits // 8), self.codes.shape
        assert self.zeros is None or self.zeros.shape == (n, blocks)
        assert self.offsets is None or self.offsets.shape == (n, blocks)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight."""
        n, blocks = self.scales.shape
        return n, blocks * self.block_size

    def rows(self, index) -> BlockQuantized:
        """The weight's rows `index` (a slice or an index array), as blocks."""

        def pick(a):
            return None if a is None else np.ascontiguousarray(a[index])

        return replace(
            self,
            codes=pick(self.codes),
            scales=pick(self.scales),
            zeros=pick(self.zeros),
            offsets=pick(self.offsets),
        )

    @staticmethod
    def stack(parts: list[BlockQuantized]) -> BlockQuantized | None:
        """The weights `parts` (same K) as one, their rows in order; None when their bits or
        block sizes differ. A part without zero points gets the default 2 ** (bits - 1), one
        without offsets zeros, so each row computes exactly what it did alone."""
        first = parts[0]
        kind = (first.bits, first.block_size, first.shape[1])
        if any((p.bits, p.block_size, p.shape[1]) != kind for p in parts):
            return None

        def joined(field: str, fill, dtype) -> np.ndarray | None:
            arrays = [getattr(p, field) for p in parts]
            if all(a is None for a in arrays):
                return None
            filled = [
                np.full(p.scales.shape, fill, dtype) if a is None else a
                for p, a in zip(parts, arrays)
            ]
            return np.concatenate(filled)

        return BlockQuantized(
            bits=first.bits,
            block_size=first.block_size,
            codes=np.concatenate([p.codes for p in parts]),
            scales=np.concatenate([p.scales for p in parts]),
            zeros=joined("zeros", 2 ** (first.bits - 1), np.uint8),
            offsets=joined("offsets", 0.0, np.float32),
            method=" + ".join(dict.fromkeys(p.method for p in parts)),
        )

    def dequantize(self) -> np.ndarray:
        """W as float32 [N, K]: the numbers the quantized graph multiplies by."""
        n, k = self.shape
        codes = unpack_codes(self.codes, self.bits).astype(np.float32)  # [N, blocks, block]
        zeros = np.float32(2 ** (self.bits - 1)) if self.zeros is None else self.zeros[..., None]
        w = (codes - zeros) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(n, k).astype(np.float32)

    def packed_zero_points(self) -> np.ndarray | None:
        """MatMulNBits' zero_points input: uint8 [N * ceil(blocks * bits / 8)], each row's
        block zero points packed low bits first (4 bits: two per byte)."""
        if self.zeros is None:
            return None
        if self.bits == 8:
            return self.zeros.reshape(-1)
        n, blocks = self.zeros.shape
        padded = np.zeros((n, blocks + blocks % 2), dtype=np.uint8)
        padded[:, :blocks] = self.zeros
        return (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)


def tile_blocks(q: BlockQuantized) -> TiledBlocks:
    """q (4 or 8 bits) in ort_lora.QuantMatMul's layout (ort_lora/quant_tiles.py)."""
    codes = unpack_codes(q.codes, q.bits).reshape(q.shape)
    return quant_tiles.tile(codes, q.scales, q.zeros, q.offsets, q.block_size, q.bits)


def untile_blocks(t: TiledBlocks, n: int, method: str = "exported") -> BlockQuantized:
    """tile_blocks' inverse: the first n columns of t as BlockQuantized of t's bits."""
    codes, scales, zeros, offsets, block = quant_tiles.untile(t, n)
    return BlockQuantized(
        bits=t.bits,
        block_size=block,
        codes=pack_codes(codes, t.bits, block),
        scales=scales,
        zeros=zeros,
        offsets=offsets,
        method=method,
    )


def pack_codes(q: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Codes uint8 [N, K] (each < 2 ** bits) -> MatMulNBits' B [N, K / block, block * bits / 8]."""
    n, k = q.shape
    q = q.astype(np.uint8).reshape(n, k // block_size, block_size)
    if bits == 8:
        return np.ascontiguousarray(q)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))


def unpack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B [N, blocks, blob] -> codes uint8 [N, blocks, block]."""
    if bits == 8:
        return codes
    n, blocks, blob = codes.shape
    out = np.empty((n, blocks, 2 * blob), dtype=np.uint8)
    out[..., 0::2] = codes & 0x0F
    out[..., 1::2] = codes >> 4
    return out


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> BlockQuantized:
    """Round-to-nearest block quantization of W [N, K] (float).

    symmetric: no zero-point input (the op's default 2 ** (bits - 1)); the block's value of
    largest magnitude maps to the lowest code exactly (llama.cpp's Q4_0 / Q8_0 rule), so all
    2 ** bits codes are used. asymmetric: the block's range [min(w, 0), max(w, 0)] spread over
    the codes, an integer zero point per block (0 stays exactly representable).
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // block_size, block_size)
    top = 2**bits - 1
    if symmetric:
        mid = 2 ** (bits - 1)
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        extreme = np.take_along_axis(blocks, idx, axis=-1)[..., 0]
        scales = extreme / -mid
        zeros = None
        zero_values = np.float32(mid)
    else:
        lo = np.minimum(blocks.min(axis=-1), 0.0)
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scales = (hi - lo) / top
        safe = np.where(scales == 0, 1.0, scales)
        zeros = np.clip(np.rint(-lo / safe), 0, top).astype(np.uint8)
        zero_values = zeros[..., None].astype(np.float32)
    scales = scales.astype(np.float32)
    safe = np.where(scales == 0, np.float32(1.0), scales)[..., None]
    q = np.clip(np.rint(blocks / safe) + zero_values, 0, top).astype(np.uint8)
    return BlockQuantized(
        bits=bits,
        block_size=block_size,
        codes=pack_codes(q.reshape(n, k), bits, block_size),
        scales=scales,
        zeros=zeros,
        offsets=None,
        method="rtn",
    )


def quantize_hqq(
    w: np.ndarray,
    block_size: int,
    iters: int = 20,
    p: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
) -> BlockQuantized:
    """4-bit asymmetric block quantization of W [N, K] refined HQQ-style (half-quadratic
    quantization, Badri & Shaji 2023): round-to-nearest's scales kept, each block's zero point
    made a float that minimizes the l_p error (p < 1: a few large errors cost less than many
    small ones) by alternating W_e = shrink_p(W - (Q - z) s) and z = mean(Q - (W - W_e) / s),
    Q = round(W / s + z); the iteration with the lowest mean |error| is kept. The float zero
    point z is stored as the integer zero round(z) plus a per-block offset (round(z) - z) s,
    which both ops add (offsets)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    start = quantize_rtn(w, 4, block_size, symmetric=False)
    blocks = w.reshape(n, k // block_size, block_size).astype(np.float64)
    s = start.scales.astype(np.float64)[..., None]
    safe = np.where(s == 0, 1.0, s)
    z = start.zeros.astype(np.float64)[..., None]
    best = (np.inf, None, None)
    for _ in range(iters):
        q = np.clip(np.rint(blocks / safe + z), 0, 15)
        err = blocks - (q - z) * s
        score = float(np.abs(err).mean())
        if score >= best[0]:
            break
        best = (score, q, z)
        mag = np.abs(err)
        with np.errstate(divide="ignore"):  # |0| ** (p - 1) = inf: shrunk to 0
            w_e = np.sign(err) * np.maximum(mag - mag ** (p - 1) / beta, 0.0)
        z = np.mean(q - (blocks - w_e) / safe, axis=-1, keepdims=True)
        beta *= kappa
    _, q, z = best
    zeros = np.clip(np.rint(z), 0, 15)
    return BlockQuantized(
        bits=4,
        block_size=block_size,
        codes=pack_codes(q.astype(np.uint8).reshape(n, k), 4, block_size),
        scales=start.scales,
        zeros=zeros[..., 0].astype(np.uint8),
        offsets=((zeros - z) * s)[..., 0].astype(np.float32),
        method="hqq",
    )


def check_block_size(block_size: int) -> None:
    """A block size MatMulNBits accepts, or an ExportError naming --block-size-q."""
    if (
        not isinstance(block_size, int)
        or block_size < MIN_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ExportError(
            f"--block-size-q {block_size!r}: ONNX Runtime's MatMulNBits needs a power of two "
            f">= {MIN_BLOCK_SIZE} (e.g. 32, the default)"
        )


def check_divides(block_size: int, tensor: str, k: int) -> None:
    """An ExportError unless `block_size` divides the input size `k` of `tensor`."""
    if k % block_size:
        raise ExportError(
            f"--block-size-q {block_size} does not divide the input size {k} of tensor "
            f"{tensor}; use a block size that divides every quantized input size"
        )


def quantize_activations(x: np.ndarray, block_size: int) -> np.ndarray:
    """x [..., K] after MatMulNBits' accuracy_level 4 input quantization, as float32.

    Semantics: each block of `block_size` values along K is quantized symmetrically to int8
    with scale amax / 127 (inverse computed as 127 / amax, as ONNX Runtime's MLAS does),
    rounded to nearest, ties to even, then multiplied back."""
    x = np.asarray(x, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, block_size)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    safe = np.where(amax == 0, np.float32(1.0), amax)
    inv = np.where(amax == 0, np.float32(0.0), np.float32(127.0) / safe)
    q = np.rint(blocks * inv)
    return (q * (amax / np.float32(127.0))).astype(np.float32).reshape(x.shape)
