"""The CUDA LoraSGMV kernels vs the numpy reference (ort_lora/ops/lora_sgmv_ref.py), through
the library's ort_lora_cuda_sgmv entry (same plan and kernels as the CUDA EP op).

Device tests are skipped when no CUDA device is visible (this needs a GPU and a driver); the
CPU tests check that the library's CUDA helpers fail cleanly without one.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from ort_lora.ops.lora_sgmv_ref import lora_sgmv, place_random_adapters
from ort_lora.runtime.cuda_pool import CudaError, CudaPool, CudaRuntime
from ort_lora.runtime.cuda_sgmv import (
    from_storage,
    lora_sgmv_numpy,
    lora_sgmv_ptrs,
    sgmv_stats,
    to_storage,
)

TOLERANCE = {"float16": 2e-3, "bfloat16": 2e-2}  # relative to the output's scale


def runtime_or_skip(need_device: bool) -> CudaRuntime:
    try:
        rt = CudaRuntime()
    except CudaError as e:
        pytest.skip(f"op library has no CUDA helpers: {e}")
    if need_device and rt.device_count() < 1:
        pytest.skip("no CUDA device visible (cudaGetDeviceCount = 0): the kernels need a GPU")
    return rt


def segments(layout: str, num_slots: int, rng) -> tuple[list[int], list[int]]:
    """(lengths, slots): distinct = decode rows (BGMV), uniform / skewed = prefill (SGMV)."""
    if layout == "distinct":
        lengths = [1] * 12
    elif layout == "uniform":
        lengths = [37] * 3
    elif layout == "skewed":
        lengths = [70, 3, 1, 0, 18, 2]
    else:  # identical: one adapter for all rows
        lengths = [53]
    slots = [int(s) for s in rng.integers(-1, num_slots, len(lengths))]
    if layout == "identical":
        slots = [0]
    return lengths, slots


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("ranks", [[8], [4, 16, 64], [1, 33, 128]])
@pytest.mark.parametrize("layout", ["distinct", "uniform", "skewed", "identical"])
def test_kernel_matches_reference(dtype, ranks, layout):
    check_against_reference(runtime_or_skip(need_device=True), dtype, ranks, layout)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_in_place_matches_reference(dtype):
    """y_out is y's buffer (ORT may run the op in place): no copy, the same result."""
    rt = runtime_or_skip(need_device=True)
    before = sgmv_stats(rt)
    check_against_reference(rt, dtype, [4, 16, 64], "skewed", in_place=True)
    assert sgmv_stats(rt)["y_copies"] == before["y_copies"]


def test_every_layer_of_a_step_reuses_the_modules_upload():
    """The device side of test_cuda_emu.py::test_a_step_uploads_each_module_plan_once: one
    upload per module and step on one stream, each layer's own pool, ranks and scales."""
    rt = runtime_or_skip(need_device=True)
    from test_cuda_emu import MODULES, STEP_LAYERS, step_cases

    cases, stream = step_cases(np.random.default_rng(31), [3, 1, 18, 0, 2]), rt.stream()
    before = sgmv_stats(rt)
    try:
        for layer in range(STEP_LAYERS):
            for c in cases.values():
                key, value = c["pools"][layer]
                inputs = [to_storage(a, "float16") for a in (c["y"], c["x"], key, value)]
                got = lora_sgmv_numpy(rt, "float16", *inputs, c["meta"], layer, stream=stream)
                want = lora_sgmv(*[from_storage(a, "float16") for a in inputs],
                                 **c["meta"], layer=layer)  # fmt: skip
                atol = TOLERANCE["float16"] * np.abs(want).max()
                np.testing.assert_allclose(from_storage(got, "float16"), want, rtol=0, atol=atol)
    finally:
        rt.call("sgmv_release_stream", ctypes.c_void_p(stream))
        rt.call("stream_destroy", ctypes.c_void_p(stream))
    after = sgmv_stats(rt)
    assert after["uploads"] - before["uploads"] == len(MODULES)
    assert after["reused"] - before["reused"] == len(MODULES) * (STEP_LAYERS - 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["decode", "prefill", "mixed"])
def test_dora_and_composed_segments_match_reference(dtype, layout, rng):
    """The device side of test_cuda_emu.py::test_dora_and_composed_tiles_match_reference."""
    rt = runtime_or_skip(need_device=True)
    from test_cuda_emu import LAYOUTS, add_composition, make_case

    dora = [1, 4]
    case = make_case(rng, LAYOUTS[layout], in_f=136, out_f=300, dora_slots=dora)
    lengths = np.diff(case["meta"]["seg_starts"])
    with_rows = rng.permutation(np.flatnonzero(lengths))
    case["meta"]["seg_slots"][with_rows[:4]] = [1, 4, -1, 0]
    add_composition(rng, case, dora)
    placed, meta = case["placed"], case["meta"]
    inputs = [to_storage(a, dtype) for a in (case["y"], case["x"])]
    inputs += [to_storage(placed.key_cache, dtype), to_storage(placed.value_cache, dtype)]
    got = from_storage(lora_sgmv_numpy(rt, dtype, *inputs, meta, case["layer"]), dtype)
    want = lora_sgmv(*[from_storage(a, dtype) for a in inputs], **meta, layer=case["layer"])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * np.abs(want).max())


def check_against_reference(rt, dtype: str, ranks: list[int], layout: str, in_place=False):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, ranks, layout)).encode()))
    in_f, out_f, layer = 200, 328, 1
    placed = place_random_adapters(rng, ranks, in_f, out_f)
    lengths, slots = segments(layout, len(ranks), rng)
    rows = sum(lengths)
    meta = {
        "seg_starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        "seg_slots": np.asarray(slots, np.int32),
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": np.tile(np.asarray(ranks, np.int32), (3, 1)),
        "scales": rng.uniform(0.5, 2.0, (3, len(ranks))).astype(np.float32),
    }
    x = to_storage(rng.standard_normal((rows, in_f)).astype(np.float32), dtype)
    y = to_storage(rng.standard_normal((rows, out_f)).astype(np.float32), dtype)
    key, value = to_storage(placed.key_cache, dtype), to_storage(placed.value_cache, dtype)
    got = lora_sgmv_numpy(rt, dtype, y, x, key, value, meta, layer, in_place=in_place)
    got = from_storage(got, dtype)
    f = [from_storage(a, dtype) for a in (y, x, key, value)]
    want = lora_sgmv(*f, **meta, layer=layer)
    assert np.isfinite(got).all(), "the kernel read pool elements outside the adapter rows"
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE[dtype] * scale)


def test_bad_offset_is_a_clear_error():
    rt = runtime_or_skip(need_device=True)
    rng = np.random.default_rng(5)
    placed, meta = one_adapter_case(rng)
    placed.a_offsets[0, 2] = 10**9
    x = rng.standard_normal((3, 64)).astype(np.float16)
    with pytest.raises(ValueError, match=r"a_offsets\[0, 2\] = 1000000000 is an out-of-range"):
        lora_sgmv_numpy(rt, "float16", x, x, placed.key_cache.astype(np.float16),
                        placed.value_cache.astype(np.float16), meta, 0)  # fmt: skip


def test_without_a_device_the_helpers_fail_cleanly():
    rt = runtime_or_skip(need_device=False)
    if rt.device_count() > 0:
        pytest.skip("a CUDA device is visible: this checks the no-GPU path")
    with pytest.raises(CudaError, match="ort_lora_cuda_malloc failed"):
        rt.malloc(1024)
    from test_cuda_pool import manifest

    with pytest.raises(CudaError, match="no CUDA device is visible"):
        CudaPool(manifest(), 4, rt)


def test_unknown_dtype_is_refused_before_any_cuda_call():
    """Needs no device: the C entry checks dtype before it touches metadata or CUDA."""
    rt = runtime_or_skip(need_device=False)
    args = [ctypes.c_int(7)] + [ctypes.c_void_p(0)] * 5 + [ctypes.c_int64(0)]
    args += [ctypes.c_void_p(0)] * 2 + [ctypes.c_int64(1)] + [ctypes.c_void_p(0)] * 2
    args += [ctypes.c_int64(1)] * 2 + [ctypes.c_void_p(0)] * 2 + [ctypes.c_int64(1)]
    args += [ctypes.c_int64(0)] + [ctypes.c_int64(1)] * 3
    args += [ctypes.c_void_p(0)] * 3 + [ctypes.c_int64(0)] + [ctypes.c_void_p(0)]  # comp, DoRA
    args += [ctypes.c_void_p(0)]  # the stream
    assert rt.lib.ort_lora_cuda_sgmv(*args) == -1
    msg = rt.lib.ort_lora_cuda_error_string(-1).decode()
    assert msg == "dtype must be 0 (float16) or 1 (bfloat16), got 7"
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16, got 'float32'"):
        lora_sgmv_ptrs(rt, "float32", 0, 0, 0, 0, 0, 0, {}, 0, 1, 1, 1, stream=1)


def test_a_null_stream_is_refused_before_any_cuda_call():
    """Needs no device: the metadata is checked on the host (pool addresses are only added to,
    never read), then the null stream is refused before the first CUDA call."""
    rt = runtime_or_skip(need_device=False)
    placed, meta = one_adapter_case(np.random.default_rng(6))
    half = placed.key_cache.size
    with pytest.raises(ValueError, match="the CUDA stream is null: LoraSGMV.CUDA. runs only on"):
        lora_sgmv_ptrs(rt, "float16", 1 << 20, 2 << 20, 3 << 20, 1 << 30, (1 << 30) + 2 * half,
                       half, meta, 0, 3, 64, 64, stream=0)  # fmt: skip


def one_adapter_case(rng):
    """(placed, meta): one rank-4 adapter (64 -> 64) in slot 0, one segment of 3 rows."""
    placed = place_random_adapters(rng, [4], 64, 64)
    meta = {
        "seg_starts": np.array([0, 3], np.int32),
        "seg_slots": np.array([0], np.int32),
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": np.array([[4]], np.int32),
        "scales": np.array([[1.0]], np.float32),
    }
    return placed, meta
