"""Where the bytes of the CUDA device pool lie (cuda_pool.py): its size, the slice each
key_cache.{l} / value_cache.{l} is bound to, and the cudaMemcpy2DAsync copies that move a
staged adapter into its pages. Pure arithmetic, unit-tested on CPU.

The pool is [num_layers, 2 (K|V), num_pages, block_size, kv_heads, head_dim], as on CPU; the
staging of an adapter load is a pool of len(pages) pages in the same layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ort_lora import contract as C

ELEM_BYTES = {"float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PoolBinding:
    """One graph input bound to a slice of the device pool."""

    name: str  # key_cache.{l} or value_cache.{l}
    shape: tuple[int, int, int, int]  # [num_pages, block_size, kv_heads, head_dim]
    ptr: int  # device address of its first element


def pool_bytes(manifest: C.ModelManifest, num_pages: int) -> int:
    """Bytes of the whole device pool."""
    return 2 * manifest.num_layers * num_pages * manifest.page_elems * _elem_bytes(manifest)


def pool_bind_plan(manifest: C.ModelManifest, num_pages: int, base_ptr: int) -> list[PoolBinding]:
    """Where each key_cache.{l} / value_cache.{l} lives inside the allocation at base_ptr."""
    m = manifest
    half_bytes = num_pages * m.page_elems * _elem_bytes(m)
    shape = (num_pages, m.block_size, m.num_kv_heads, m.head_dim)
    out = []
    for layer in range(m.num_layers):
        for half, name in ((0, C.key_cache_name(layer)), (1, C.value_cache_name(layer))):
            out.append(PoolBinding(name, shape, base_ptr + (2 * layer + half) * half_bytes))
    return out


@dataclass(frozen=True)
class Copy2D:
    """One cudaMemcpy2DAsync: `height` rows (layers) of `width` bytes."""

    dst_offset: int  # bytes from the pool base
    dst_pitch: int
    src_offset: int  # bytes from the staging base
    src_pitch: int
    width: int
    height: int


def page_runs(pages: Iterable[int]) -> list[tuple[int, int, int]]:
    """(index in pages, first page, count) for each run of consecutive page numbers."""
    pages = [int(p) for p in pages]
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs


def upload_copies(manifest: C.ModelManifest, num_pages: int, pages: list[int]) -> list[Copy2D]:
    """The copies that move a staging pool of len(pages) pages into `pages` of the device pool.

    Staging page i (both halves, every layer) goes to pool page pages[i]; a run of consecutive
    pages in one half is one 2D copy over all layers.
    """
    page_bytes = manifest.page_elems * _elem_bytes(manifest)
    n = len(pages)
    copies = []
    for half in (0, 1):
        for index, first, count in page_runs(pages):
            copies.append(
                Copy2D(
                    dst_offset=(half * num_pages + first) * page_bytes,
                    dst_pitch=2 * num_pages * page_bytes,
                    src_offset=(half * n + index) * page_bytes,
                    src_pitch=2 * n * page_bytes,
                    width=count * page_bytes,
                    height=manifest.num_layers,
                )
            )
    return copies


def _elem_bytes(manifest: C.ModelManifest) -> int:
    if manifest.dtype not in ELEM_BYTES:
        raise ValueError(
            f"a CUDA pool holds float16 or bfloat16; the model's dtype is {manifest.dtype}"
        )
    return ELEM_BYTES[manifest.dtype]
