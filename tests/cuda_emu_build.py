"""Builds the CUDA-on-CPU emulator library and calls it (tests/test_cuda_emu.py).

The very same kernel source (custom_ops/cuda/lora_sgmv_kernels.cu) is compiled by g++ as C++
with ORT_LORA_CUDA_EMU defined, together with the host plan (sgmv_plan.cc, and
lora_sgmv/lora_sgmv_checks.cc: the metadata checks it shares with the CPU op), the emulator
(custom_ops/cuda/emu/) and its self-test kernels; no nvcc, no CUDA runtime, no GPU. Only the
CUDA headers are needed (types and host conversion functions). The kernel objects' .bss (their
`__shared__` statics, and nothing else: checked with nm) is renamed to the section the emulator
poisons at every block start.
"""

from __future__ import annotations

import ctypes
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

    def error(self, rc: int) -> str:
        return self.lib.ort_lora_emu_error_string(rc).decode(errors="replace")

    def stats(self) -> dict:
        """switches (fiber context switches so far), stack_used / stack_bytes (per fiber)."""
        vals = [ctypes.c_uint64() for _ in range(3)]
        self.lib.ort_lora_emu_stats(*map(ctypes.byref, vals))
        return dict(zip(["switches", "stack_used", "stack_bytes"], (v.value for v in vals)))

    def sgmv(self, dtype: str, y, x, key_cache, value_cache, meta: dict, layer: int) -> np.ndarray:
        """LoraSGMV through ort_lora_emu_sgmv; arrays are 16-bit (float16, or uint16 bfloat16
        bits). Returns y_out; raises ValueError (invalid input) or RuntimeError (launch)."""
        arrays = [np.ascontiguousarray(a) for a in (x, y, key_cache, value_cache)]
        if any(a.itemsize != 2 for a in arrays):
            raise ValueError("x, y, key_cache and value_cache must be 16-bit arrays")
        out = np.empty_like(arrays[1])  # [T, out]
        p = [a.ctypes.data for a in (*arrays, out)]
        args, _keep = sgmv_c_args(dtype, p[0], p[1], p[4], p[2], p[3], arrays[2].size, meta,
                                  layer, arrays[1].shape[0], arrays[0].shape[1],
                                  arrays[1].shape[1])  # fmt: skip
        rc = self.lib.ort_lora_emu_sgmv(*args)
        if rc != 0:
            raise (ValueError if rc == -1 else RuntimeError)(f"LoraSGMV(emu): {self.error(rc)}")
        return out

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
