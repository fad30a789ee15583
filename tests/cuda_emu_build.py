"""Builds the CUDA-on-CPU emulator library and calls it (tests/test_cuda_emu.py).

The very same kernel source (custom_ops/cuda/lora_sgmv_kernels.cu) is compiled by g++ as C++
with ORT_LORA_CUDA_EMU defined, together with the host plan (sgmv_plan.cc, and
lora_sgmv/lora_sgmv_checks.cc: the metadata checks it shares with the CPU op), the host run
(sgmv_run.cc: the per-stream plan uploads and scratch the op uses) over an emulated CUDA runtime
(emu/cuda_emu_runtime.cc), the emulator (custom_ops/cuda/emu/) and its self-test kernels; no
nvcc, no CUDA runtime, no GPU. Only the CUDA headers are needed (types and host conversion
functions). The kernel objects' .bss (their
`__shared__` statics, and nothing else: checked with nm) is renamed to the section the emulator
poisons at every block start.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ort_lora.runtime.cuda_sgmv import DTYPES, sgmv_c_args

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "custom_ops" / "cuda"
SHARED_SECTION = "ort_lora_emu_shared"
KERNEL_SOURCES = [CUDA_DIR / "lora_sgmv_kernels.cu", CUDA_DIR / "emu" / "emu_selftest.cc"]
HOST_SOURCES = [
    CUDA_DIR / "sgmv_plan.cc",
    CUDA_DIR / "sgmv_run.cc",
    CUDA_DIR / "emu" / "cuda_emu_runtime.cc",
    ROOT / "custom_ops" / "lora_sgmv" / "lora_sgmv_checks.cc",
    CUDA_DIR / "emu" / "cuda_emu.cc",
    CUDA_DIR / "emu" / "emu_sgmv_c.cc",
]
FLAGS = ["-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-DORT_LORA_CUDA_EMU"]
FLAGS += ["-Wall", "-Wextra", "-Wno-unknown-pragmas"]


def cuda_include_dir() -> Path | None:
    """The CUDA headers: $CUDA_HOME, $CUDA_PATH, next to nvcc, or /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in filter(None, candidates):
        if (Path(c) / "include" / "cuda_fp16.h").is_file():
            return Path(c) / "include"
    return None


def missing_tools() -> str | None:
    """Why the emulator cannot be built here (None if it can)."""
    if cuda_include_dir() is None:
        return "no CUDA headers (CUDA_HOME, nvcc, /usr/local/cuda)"
    missing = [t for t in ("g++", "objcopy", "nm") if shutil.which(t) is None]
    return f"missing tools: {', '.join(missing)}" if missing else None


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")


def _check_only_shared_statics(obj: Path) -> None:
    """Every .bss symbol of a kernel object must be a function-local static (__shared__)."""
    out = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[1] in "bB" and ")::" not in parts[2]:
            raise RuntimeError(f"{obj.name}: .bss symbol {parts[2]!r} is not a __shared__ static")


def build_emu_library(out_dir: Path) -> Path:
    """Compiles and links libort_lora_cuda_emu.so into out_dir; returns its path."""
    include = ["-I", str(ROOT / "custom_ops"), "-I", str(cuda_include_dir())]
    objects = {src: out_dir / f"{src.stem}.o" for src in KERNEL_SOURCES + HOST_SOURCES}

    def compile_one(src: Path) -> None:
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        _run(["g++", *FLAGS, *include, *lang, "-c", str(src), "-o", str(objects[src])])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(compile_one, objects))
    for src in KERNEL_SOURCES:
        _check_only_shared_statics(objects[src])
        _run(["objcopy", f"--rename-section=.bss={SHARED_SECTION}", str(objects[src])])
    lib = out_dir / "libort_lora_cuda_emu.so"
    _run(["g++", "-shared", "-Wl,--no-undefined", "-o", str(lib), *map(str, objects.values())])
    return lib


class EmuLibrary:
    """ctypes wrapper of the emulator library's C entries."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.ort_lora_emu_error_string.restype = ctypes.c_char_p
        self.lib.ort_lora_emu_shared_bytes.restype = ctypes.c_uint64
        self.lib.ort_lora_emu_runtime_count.restype = ctypes.c_uint64
        self._streams = itertools.count(0x5000, 0x10)  # fresh opaque stream handles

    def error(self, rc: int) -> str:
        return self.lib.ort_lora_emu_error_string(rc).decode(errors="replace")

    def stats(self) -> dict:
        """switches (fiber context switches so far), stack_used / stack_bytes (per fiber)."""
        vals = [ctypes.c_uint64() for _ in range(3)]
        self.lib.ort_lora_emu_stats(*map(ctypes.byref, vals))
        return dict(zip(["switches", "stack_used", "stack_bytes"], (v.value for v in vals)))

    def sgmv(self, dtype: str, y, x, key_cache, value_cache, meta: dict, layer: int,
             stream: int | None = None, in_place: bool = False) -> np.ndarray:  # fmt: skip
        """LoraSGMV through ort_lora_emu_sgmv; arrays are 16-bit (float16, or uint16 bfloat16
        bits). Returns y_out (in_place: y_out is a copy of y passed as both y and y_out).
        stream None: a fresh stream handle, released after the call (its scratch is fresh,
        poisoned memory); else that handle, whose uploads and scratch stay for later calls.
        Raises ValueError (invalid input) or RuntimeError (a failed emulated CUDA call)."""
        arrays = [np.ascontiguousarray(a) for a in (x, y, key_cache, value_cache)]
        if any(a.itemsize != 2 for a in arrays):
            raise ValueError("x, y, key_cache and value_cache must be 16-bit arrays")
        out = np.array(arrays[1]) if in_place else np.empty_like(arrays[1])  # [T, out]
        p = [a.ctypes.data for a in (*arrays, out)]
        y_ptr = p[4] if in_place else p[1]
        handle = next(self._streams) if stream is None else stream
        args, _keep = sgmv_c_args(dtype, p[0], y_ptr, p[4], p[2], p[3], arrays[2].size, meta,
                                  layer, arrays[1].shape[0], arrays[0].shape[1],
                                  arrays[1].shape[1], handle)  # fmt: skip
        try:
            rc = self.lib.ort_lora_emu_sgmv(*args)
        finally:
            if stream is None:
                self.release(handle)
        if rc != 0:
            raise (ValueError if rc == -1 else RuntimeError)(f"LoraSGMV(emu): {self.error(rc)}")
        return out

    def release(self, stream: int) -> None:
        """Frees what RunLoraSgmv keeps for the stream (ReleaseSgmvStream)."""
        rc = self.lib.ort_lora_emu_release_stream(ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"ReleaseSgmvStream failed: {self.error(rc)}")

    def sgmv_stats(self) -> dict:
        """The process's RunLoraSgmv counters (SgmvStats)."""
        out = (ctypes.c_uint64 * 4)()
        self.lib.ort_lora_emu_sgmv_stats(out)
        return dict(zip(("uploads", "reused", "host_waits", "y_copies"), out))

    def runtime_reset(self, pending_events: bool = False) -> None:
        """Clears the emulated runtime's call log; pending_events: recorded events stay not
        ready until synchronized (the host would wait on them)."""
        self.lib.ort_lora_emu_runtime_reset(int(pending_events))

    def calls(self, call: str, stream: int | None = None) -> int:
        """Emulated runtime calls named `call` since the reset, on `stream` (None: any)."""
        return self.lib.ort_lora_emu_runtime_count(
            call.encode(), ctypes.c_void_p(stream or 0), int(stream is None)
        )

    def live(self) -> dict:
        """Live emulated device allocations, pinned host allocations and events."""
        out = (ctypes.c_uint64 * 3)()
        self.lib.ort_lora_emu_runtime_live(out)
        return dict(zip(("device", "host", "events"), out))

    def selftest(self, which: int, data: np.ndarray, blocks: int, threads: int):
        """(rc, out float32 [blocks * threads]) of self-test kernel `which` (emu_selftest.cc)."""
        data = np.ascontiguousarray(data, np.float32)
        out = np.full(blocks * threads, -7.0, np.float32)
        f = ctypes.POINTER(ctypes.c_float)
        rc = self.lib.ort_lora_emu_selftest(
            which, data.ctypes.data_as(f), out.ctypes.data_as(f), blocks, threads
        )
        return rc, out

    def round(self, dtype: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bits uint16, back float32) of the host conversions the kernels use."""
        values = np.ascontiguousarray(values, np.float32)
        bits = np.empty(values.shape, np.uint16)
        back = np.empty(values.shape, np.float32)
        self.lib.ort_lora_emu_round(
            DTYPES[dtype], values.ctypes.data_as(ctypes.c_void_p),
            bits.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int64(values.size),
        )  # fmt: skip
        return bits, back
