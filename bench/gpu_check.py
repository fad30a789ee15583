"""One-shot GPU check of the CUDA path: build, kernel tests, end to end, timing.

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py [--out-dir DIR] [--allow-skip]

Sections, in this order; each is isolated (a failure is recorded, the next section runs):
  build    cmake build of the op library with nvcc for sm_90 (FAILED when nvcc is missing or
           the library lacks the CUDA entries: never a silent CPU-only build); ORT headers from
           --ort-include or the carried build/*/ort_headers tree; ORT_LORA_LIBRARY set to it
  cpu_ops  the library loads in onnxruntime
  kernel   pytest tests/test_cuda_sgmv.py on the device: kernels vs numpy (dtype x ranks x
           layout), in place, one plan upload per module and step, errors (FAILED if a device
           test is skipped)
  pool     CudaPool: adapter uploads read back equal the CPU pool; close() gives the memory back
  e2e      needs onnxruntime-gpu (CUDAExecutionProvider); a tiny Llama exported for
           --device cuda, against the CPU export of the same rounded weights:
             (a) every LoraSGMV and PagedAttention node runs on CUDAExecutionProvider (profile)
             (b) after one prefill the device pool's K and V pages equal the CPU pool's
             (c) float16: 16 greedy tokens of base + 3 adapters in one batch equal the CPU
                 engine's, or part only where the CPU's top-2 margin is within 4x the measured
                 logit error (reported with the step and margin); LoRA plan uploads per step
             (d) the same in bfloat16
  timing   LoraSGMV kernel time (a CUDA graph of launches, CUDA events) vs a cuBLAS matmul of
           the same FLOPs (torch, CUDA graph), decode and prefill, plus host time per call; with
           onnxruntime-gpu also engine tokens/s: base only vs one adapter vs distinct adapters
Writes DIR/gpu_check-YYYY-MM-DD.json and .log (all output, C++ and subprocesses included) and
prints a table last. Needs numpy, torch (CUDA), safetensors and cmake; nothing from the network.

Exit codes:
  0  every section ran and passed: VERIFIED on this machine
  1  a section FAILED
  2  usage error
  3  NOT VERIFIED: nothing failed, but a section was skipped (e.g. e2e without
     CUDAExecutionProvider); --allow-skip makes this 0

On a GPU machine: replace the CPU onnxruntime with onnxruntime-gpu in the venv
(`.venv/bin/pip uninstall -y onnxruntime && .venv/bin/pip install onnxruntime-gpu`), build the
project once (or pass --ort-include) so that build/*/ort_headers holds ONNX Runtime's headers,
and run this with the venv's python; docs/CUDA.md, "Running the GPU check", has the details.
About 3 to 5 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))
sys.path.insert(2, str(ROOT / "bench"))
from gpu_check_e2e import check_end_to_end, engine_throughput, read_pool  # noqa: E402

RESULTS: dict[str, dict] = {}
STATE: dict = {"models": {}}  # the e2e exports per dtype, for the engine timing


class Skipped(Exception):
    """A section that cannot run on this machine: reported, and the verdict is NOT VERIFIED."""


def section(name: str):
    """Decorator: run fn, record ok / FAILED / SKIPPED with its details, never raise."""

    def wrap(fn):
        def run(*args):
            t0 = time.time()
            print(f"\n== {name}", flush=True)
            try:
                RESULTS[name] = {"status": "ok", **(fn(*args) or {})}
            except Skipped as e:
                RESULTS[name] = {"status": "SKIPPED", "reason": str(e)}
            except Exception as e:  # noqa: BLE001  (each section reports, the next one runs)
                traceback.print_exc()
                RESULTS[name] = {"status": "FAILED", "error": f"{type(e).__name__}: {e}"}
            RESULTS[name]["seconds"] = round(time.time() - t0, 1)
            print(f"-- {name}: {RESULTS[name]['status']}", flush=True)

        return run

    return wrap


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Runs cmd, echoing its output into the log."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    print(out.stdout + out.stderr, end="", flush=True)
    return out


@section("build")
def build(args) -> dict:
    nvcc = args.nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        raise FileNotFoundError(f"nvcc not found ({nvcc}): the library would be built CPU-only")
    headers = glob.glob(str(ROOT / "build/*/ort_headers/**/onnxruntime_c_api.h"), recursive=True)
    inc = args.ort_include or (str(Path(headers[0]).parent) if headers else "")
    if not inc:
        raise FileNotFoundError(
            "no ORT headers in build/*/ort_headers: build the project once (pip install -e .) "
            "or pass --ort-include DIR"
        )
    bdir = Path(args.build_dir)
    cfg = ["cmake", "-S", str(ROOT), "-B", str(bdir), f"-DORT_INCLUDE_DIR={inc}",
           f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DCMAKE_BUILD_TYPE=Release",
           "-DORT_LORA_CUDA_ARCHITECTURES=90"]  # fmt: skip
    configured = _run(cfg)
    if configured.returncode or "CUDA kernels enabled" not in configured.stdout:
        raise RuntimeError("cmake configure failed or did not enable the CUDA kernels")
    if _run(["cmake", "--build", str(bdir), "-j", str(os.cpu_count() or 8)]).returncode:
        raise RuntimeError("cmake --build failed")
    lib = bdir / "libort_lora_ops.so"
    if not hasattr(ctypes.CDLL(str(lib)), "ort_lora_cuda_sgmv_time"):
        raise RuntimeError(f"{lib} has no CUDA entries")
    os.environ["ORT_LORA_LIBRARY"] = str(lib)
    nvcc_version = _run([nvcc, "--version"]).stdout.strip().splitlines()[-1]
    return {"library": str(lib), "nvcc": nvcc_version}


@section("cpu_ops")
def cpu_ops(args) -> dict:
    import onnxruntime as ort

    import ort_lora

    ort_lora.session_options()  # registers the library: fails if it does not load
    return {"onnxruntime": ort.__version__, "providers": ort.get_available_providers()}


@section("kernel")
def kernel(args) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_cuda_sgmv.py")]  # fmt: skip
    out = _run(cmd, cwd=ROOT, env=env)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out.stdout)}
    # one test checks the no-GPU path and skips when a device is visible
    if out.returncode or counts.get("skipped", 0) > 1 or counts.get("passed", 0) < 30:
        raise AssertionError(f"device kernel tests: {counts} (rc {out.returncode})")
    return {"pytest": counts}


@section("pool")
def pool(args) -> dict:
    import torch
    from test_cuda_pool import manifest, random_adapter

    from ort_lora.adapters.layout import write_to_pool
    from ort_lora.runtime.cuda_layout import pool_bytes
    from ort_lora.runtime.cuda_pool import CudaPool, CudaRuntime

    rt, m, num_pages = CudaRuntime(), manifest(block=16), 40
    p = CudaPool(m, num_pages, rt)
    rng = np.random.default_rng(1)
    expected = np.zeros((m.num_layers, 2, num_pages, 16, m.num_kv_heads, m.head_dim), np.float16)
    for aid, pages in ((1, [5, 6, 7]), (2, [30, 2, 3]), (3, [11])):
        adapter = random_adapter(rng, m)
        write_to_pool(adapter, pages, expected)
        p.load(aid, pages, lambda s, a=adapter, n=len(pages): write_to_pool(a, range(n), s))
    p.wait_for_step()
    p.synchronize()
    np.testing.assert_array_equal(read_pool(rt, p).reshape(expected.shape), expected)
    p.close()
    big = 200_000  # pages: a pool large enough for close() to show in the free memory
    free0 = torch.cuda.mem_get_info()[0]
    q = CudaPool(m, big, rt)
    free1 = torch.cuda.mem_get_info()[0]
    q.close()
    free2 = torch.cuda.mem_get_info()[0]
    out = {"big_pool_mb": pool_bytes(m, big) >> 20, "taken_mb": (free0 - free1) >> 20,
           "given_back_mb": (free2 - free1) >> 20}  # fmt: skip
    if out["taken_mb"] < 0.9 * out["big_pool_mb"] or out["given_back_mb"] < out["taken_mb"] - 8:
        raise AssertionError(f"CudaPool.close did not give the device memory back: {out}")
    return out


# ---- end to end -------------------------------------------------------------------------------


@section("e2e")
def e2e(args) -> dict:
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA / cuDNN from the nvidia-* wheels, if that is where they are
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Skipped(
            f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install "
            "onnxruntime-gpu in place of onnxruntime: docs/CUDA.md); end to end NOT checked"
        )
    return check_end_to_end(Path(tempfile.mkdtemp(prefix="ort_lora_e2e_")), STATE["models"])


# ---- timing -----------------------------------------------------------------------------------


@section("timing")
def timing(args) -> dict:
    import torch

    from ort_lora.runtime.cuda_pool import CudaRuntime

    rt, out = CudaRuntime(), {}
    stream = torch.cuda.Stream()
    try:
        for name, rows, seg in (("decode_64", 64, 1), ("prefill_4096", 4096, 512)):
            out[name] = _time_sgmv(rt, stream, rows, seg)
    finally:
        rt.call("sgmv_release_stream", ctypes.c_void_p(stream.cuda_stream))
    if "float16" in STATE["models"]:
        out["engine_float16"] = engine_throughput(STATE["models"]["float16"])
    else:
        out["engine_float16"] = "not run: needs the e2e section (onnxruntime-gpu)"
    return out


def _time_sgmv(rt, stream, rows: int, seg: int, hidden=4096, rank=16, adapters=8) -> dict:
    """LoraSGMV (8 adapters of rank 16, `rows` rows in segments of `seg`, one adapter each, in
    turn) vs cuBLAS on one gathered adapter: the same FLOPs. Device times from CUDA graphs."""
    import torch

    dev, f16 = torch.device("cuda"), torch.float16
    # rows of A and B^T back to back: adapter a's A rows, then its B^T rows; K|V halves split
    # between adapters (no row crosses)
    pool = torch.randn(2 * adapters * rank * hidden, device=dev, dtype=f16) * 0.02
    half = pool.numel() // 2
    base = np.arange(adapters)[:, None] * 2 * rank * hidden
    a_off = (base + np.arange(rank)[None] * hidden).astype(np.int64)
    meta = {"seg_starts": np.arange(0, rows + 1, seg, dtype=np.int32),
            "seg_slots": (np.arange(rows // seg) % adapters).astype(np.int32),
            "a_offsets": a_off, "b_offsets": a_off + rank * hidden,
            "ranks": np.full((1, adapters), rank, np.int32),
            "scales": np.ones((1, adapters), np.float32)}  # fmt: skip
    x = torch.randn(rows, hidden, device=dev, dtype=f16)
    y = torch.randn(rows, hidden, device=dev, dtype=f16)
    y_out = torch.empty_like(y)
    torch.cuda.synchronize()
    from ort_lora.runtime.cuda_sgmv import sgmv_c_args

    c_args, _keep = sgmv_c_args("float16", x.data_ptr(), y.data_ptr(), y_out.data_ptr(),
                                pool.data_ptr(), pool.data_ptr() + 2 * half, half, meta, 0, rows,
                                hidden, hidden, stream.cuda_stream)  # fmt: skip
    kernel_us, host_us = ctypes.c_float(), ctypes.c_float()
    rc = rt.lib.ort_lora_cuda_sgmv_time(*c_args, 50, ctypes.byref(kernel_us), ctypes.byref(host_us))
    if rc != 0:
        raise RuntimeError(f"ort_lora_cuda_sgmv_time: {rt.lib.ort_lora_cuda_error_string(rc)}")
    wa = torch.randn(hidden, rank, device=dev, dtype=f16)
    wb = torch.randn(rank, hidden, device=dev, dtype=f16)
    dense_us = _graph_time(lambda: torch.addmm(y, x @ wa, wb, out=y_out))
    return {"sgmv_kernel_us": round(kernel_us.value, 2), "sgmv_host_us": round(host_us.value, 2),
            "dense_cublas_us": round(dense_us, 2),
            "rate_vs_dense": round(dense_us / kernel_us.value, 3)}  # fmt: skip


def _graph_time(fn, iters: int = 50) -> float:
    """Device microseconds per call of fn, replayed from one captured CUDA graph."""
    import torch

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()  # warm-up (cuBLAS handles and workspace) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


# ---- driver -----------------------------------------------------------------------------------


@contextlib.contextmanager
def tee_output(log: Path):
    """Everything written to fds 1 and 2 (C++ and subprocesses too) also goes to `log`."""
    sys.stdout.flush(), sys.stderr.flush()
    tee = subprocess.Popen(["tee", str(log)], stdin=subprocess.PIPE)
    saved = os.dup(1), os.dup(2)
    os.dup2(tee.stdin.fileno(), 1), os.dup2(tee.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        tee.stdin.close()
        tee.wait()


def machine() -> dict:
    info = {"python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(Exception):
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
    return info


def verdict(allow_skip: bool) -> tuple[str, int]:
    statuses = {r["status"] for r in RESULTS.values()}
    if "FAILED" in statuses:
        return "FAILED", 1
    if "SKIPPED" in statuses:
        return "NOT VERIFIED (a section was skipped)", 0 if allow_skip else 3
    return "VERIFIED", 0


def main() -> int:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out-dir", default=str(ROOT / "docs" / "gpu"), help="for the JSON and log")
    p.add_argument("--ort-include", default=os.environ.get("ORT_INCLUDE_DIR", ""))
    p.add_argument("--nvcc", default="", help="nvcc to build with (default: from PATH)")
    p.add_argument("--build-dir", default="/tmp/ort_lora_gpu_build")
    p.add_argument("--allow-skip", action="store_true", help="exit 0 when a section is skipped")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gpu_check-{datetime.date.today().isoformat()}"
    with tee_output(stem.with_suffix(".log")):
        for fn in (build, cpu_ops, kernel, pool, e2e, timing):
            fn(args)
        text, code = verdict(args.allow_skip)
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": machine(), "verdict": text, "sections": RESULTS}  # fmt: skip
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\n{'section':<10} {'status':<8} {'s':>6}  detail")
        for name, r in RESULTS.items():
            detail = json.dumps({k: v for k, v in r.items() if k not in ("status", "seconds")},
                                default=str)  # fmt: skip
            print(f"{name:<10} {r['status']:<8} {r['seconds']:>6}  {detail[:150]}")
        print(f"\n{text}; wrote {stem}.json and .log; exit {code}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
