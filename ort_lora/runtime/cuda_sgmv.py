"""LoraSGMV on a CUDA device without ONNX Runtime: the op library's ort_lora_cuda_sgmv entry.

For checks and benchmarks (bench/gpu_check.py, tests/test_cuda_sgmv.py): the same kernels and
host plan as the CUDA EP op, fed with device pointers (`lora_sgmv_ptrs`) or numpy arrays that
are copied to the device and back (`lora_sgmv_numpy`). Metadata stays on the host.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ort_lora.bfloat16 import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from ort_lora.runtime.cuda_pool import CudaError, CudaRuntime

DTYPES = {"float16": 0, "bfloat16": 1}
D2H = 2


def sgmv_c_args(dtype: str, x: int, y: int, y_out: int, key: int, value: int, half: int,
                meta: dict, layer: int, num_rows: int, in_features: int, out_features: int,
                stream: int) -> tuple[list, dict]:  # fmt: skip
    """The arguments ORT_LORA_SGMV_C_PARAMS (sgmv_plan.h) declares, shared by
    ort_lora_cuda_sgmv and the emulator's ort_lora_emu_sgmv; and the contiguous metadata
    arrays they point into (keep them alive for the call). meta may hold the optional
    comp_segs / comp_slots / comp_weights (all or none) and dora_offsets."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    m = {
        "seg_starts": np.ascontiguousarray(meta["seg_starts"], np.int32),  # [S + 1]
        "seg_slots": np.ascontiguousarray(meta["seg_slots"], np.int32),  # [S]
        "a_offsets": np.ascontiguousarray(meta["a_offsets"], np.int64),  # [slots, max_rank]
        "b_offsets": np.ascontiguousarray(meta["b_offsets"], np.int64),  # [slots, max_rank]
        "ranks": np.ascontiguousarray(meta["ranks"], np.int32),  # [L, slots]
        "scales": np.ascontiguousarray(meta["scales"], np.float32),  # [L, slots]
        "comp_segs": np.ascontiguousarray(meta.get("comp_segs", ()), np.int32),  # [E]
        "comp_slots": np.ascontiguousarray(meta.get("comp_slots", ()), np.int32),  # [E]
        "comp_weights": np.ascontiguousarray(meta.get("comp_weights", ()), np.float32),  # [E]
        "dora_offsets": np.ascontiguousarray(meta.get("dora_offsets", ()), np.int64),  # [slots]
    }
    if not len(m["comp_segs"]) == len(m["comp_slots"]) == len(m["comp_weights"]):
        raise ValueError("comp_segs, comp_slots and comp_weights must have one length (E)")
    if len(m["dora_offsets"]) not in (0, len(m["a_offsets"])):
        raise ValueError("dora_offsets must have num_slots entries, or none (no DoRA rows)")
    v, i64 = ctypes.c_void_p, ctypes.c_int64
    # empty optional arrays are null pointers (dora_offsets: no DoRA rows)
    ptr = {k: a.ctypes.data_as(ctypes.c_void_p) if a.size else v() for k, a in m.items()}
    args = [
        ctypes.c_int(DTYPES[dtype]), v(x), v(y), v(y_out), v(key), v(value), i64(half),
        ptr["seg_starts"], ptr["seg_slots"], i64(len(m["seg_slots"])), ptr["a_offsets"],
        ptr["b_offsets"], i64(m["a_offsets"].shape[0]), i64(m["a_offsets"].shape[1]),
        ptr["ranks"], ptr["scales"], i64(m["ranks"].shape[0]), i64(layer), i64(num_rows),
        i64(in_features), i64(out_features), ptr["comp_segs"], ptr["comp_slots"],
        ptr["comp_weights"], i64(len(m["comp_segs"])), ptr["dora_offsets"], v(stream),
    ]  # fmt: skip
    return args, m


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> 16-bit storage: float16, or bfloat16 bits as uint16 (round to nearest even)."""
    return a.astype(np.float16) if dtype == "float16" else float32_to_bfloat16_bits(a)


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit storage (see to_storage) -> float32, exactly."""
    if dtype == "float16":
        return a.astype(np.float32)
    return bfloat16_bits_to_float32(a)


def lora_sgmv_ptrs(rt: CudaRuntime, dtype: str, x: int, y: int, y_out: int, key: int,
                   value: int, half: int, meta: dict, layer: int, num_rows: int,
                   in_features: int, out_features: int, stream: int) -> None:  # fmt: skip
    """Enqueue LoraSGMV on `stream` (not 0: the op refuses the legacy default stream).
    x/y/y_out/key/value: device addresses (y_out may be y); half: elements of key_cache;
    meta: seg_starts, seg_slots, a_offsets, b_offsets, ranks, scales (numpy)."""
    args, _keep = sgmv_c_args(dtype, x, y, y_out, key, value, half, meta, layer, num_rows,
                              in_features, out_features, stream)  # fmt: skip
    rc = rt.lib.ort_lora_cuda_sgmv(*args)
    if rc != 0:
        msg = rt.lib.ort_lora_cuda_error_string(rc).decode(errors="replace")
        raise (ValueError if rc == -1 else CudaError)(f"LoraSGMV(CUDA): {msg}")


def lora_sgmv_numpy(rt: CudaRuntime, dtype: str, y, x, key_cache, value_cache, meta: dict,
                    layer: int, in_place: bool = False,
                    stream: int | None = None) -> np.ndarray:  # fmt: skip
    """y_out (same 16-bit array type as y: float16, or uint16 bfloat16 bits) via the device.
    in_place: y_out is y's buffer. stream None: a stream of its own, released and destroyed
    after; else that stream (what LoraSGMV keeps for it stays: see sgmv_stats)."""
    arrays = [np.ascontiguousarray(a) for a in (x, y, key_cache, value_cache)]
    if any(a.itemsize != 2 for a in arrays):
        raise ValueError("x, y, key_cache and value_cache must be 16-bit arrays")
    ptrs = [rt.malloc(max(a.nbytes, 2)) for a in arrays] + [rt.malloc(max(arrays[1].nbytes, 2))]
    own_stream = stream is None
    stream = rt.stream() if own_stream else stream
    v, u = ctypes.c_void_p, ctypes.c_uint64
    try:
        for p, a in zip(ptrs, arrays):
            rt.call("memcpy_async", v(p), a.ctypes.data_as(v), u(a.nbytes), 1, v(stream))
        y_out = ptrs[1] if in_place else ptrs[4]
        lora_sgmv_ptrs(rt, dtype, ptrs[0], ptrs[1], y_out, ptrs[2], ptrs[3], key_cache.size,
                       meta, layer, y.shape[0], x.shape[1], y.shape[1], stream)  # fmt: skip
        out = np.empty_like(arrays[1])
        rt.call("memcpy_async", out.ctypes.data_as(v), v(y_out), u(out.nbytes), D2H, v(stream))
        rt.call("stream_synchronize", v(stream))
        return out
    finally:
        if own_stream:
            rt.lib.ort_lora_cuda_sgmv_release_stream(v(stream))
            rt.lib.ort_lora_cuda_stream_destroy(v(stream))
        for p in ptrs:
            rt.lib.ort_lora_cuda_free(v(p))


def sgmv_stats(rt: CudaRuntime) -> dict:
    """The process's LoraSGMV counters (SgmvStats, sgmv_plan.h): plans uploaded, plans reused
    from an earlier upload, uploads that waited for an older copy, y -> y_out copies."""
    out = (ctypes.c_uint64 * 4)()
    rt.call("sgmv_stats", out)
    return dict(zip(("uploads", "reused", "host_waits", "y_copies"), out))
