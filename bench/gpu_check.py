"""One-shot GPU check for the CUDA LoraSGMV, pool and engine (run on a machine with a GPU).

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py [--out results/gpu_check.json]

Sections, each in its own try/except so one failure never hides the rest:
  build    cmake build of the op library for sm_90 (ORT headers: --ort-include, or the
           build/*/ort_headers tree carried from the dev machine), ORT_LORA_LIBRARY set to it
  cpu_ops  the library still loads in onnxruntime and its CPU LoraSGMV matches numpy
  kernel   LoraSGMV (ort_lora_cuda_sgmv) vs numpy: dtype x ranks x segment layout
  errors   a bad offset comes back as a clear error, not a crash
  pool     CudaPool: pinned staging + side-stream 2D copies land exactly where the CPU pool puts
           the adapter rows (copied back and compared)
  timing   LoraSGMV vs a dense cuBLAS matmul of the same FLOPs (torch), decode and prefill
  e2e      only with onnxruntime's CUDAExecutionProvider: tiny model exported for cuda vs the
           CPU path, mixed-adapter engine throughput vs base-only
Prints a table last and writes JSON. Needs numpy and torch (CUDA) for timing; nothing else.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS: dict[str, dict] = {}


class Skipped(Exception):
    """A section that cannot run on this machine (reported as skipped, not failed)."""


def section(name: str):
    """Decorator: run fn, record ok/failed with its message, never raise."""

    def wrap(fn):
        def run(*args):
            t0 = time.time()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = {"status": "ok", **(fn(*args) or {})}
            except Skipped as e:
                RESULTS[name] = {"status": "skipped", "reason": str(e)}
            except Exception as e:  # noqa: BLE001  (each section reports, the next one runs)
                traceback.print_exc()
                RESULTS[name] = {"status": "FAILED", "error": f"{type(e).__name__}: {e}"}
            RESULTS[name]["seconds"] = round(time.time() - t0, 1)
            print(f"-- {name}: {RESULTS[name]['status']}", flush=True)

        return run

    return wrap


@section("build")
def build(args) -> dict:
    inc = args.ort_include or next(
        iter(glob.glob(str(ROOT / "build/*/ort_headers/**/onnxruntime_c_api.h"), recursive=True)),
        "",
    )  # noqa: E501
    inc = str(Path(inc).parent) if inc.endswith(".h") else inc
    if not inc:
        raise FileNotFoundError("no ORT headers: carry build/*/ort_headers or pass --ort-include")
    bdir = Path(args.build_dir)
    cfg = ["cmake", "-S", str(ROOT), "-B", str(bdir), f"-DORT_INCLUDE_DIR={inc}",
           "-DCMAKE_BUILD_TYPE=Release", "-DORT_LORA_CUDA_ARCHITECTURES=90"]  # fmt: skip
    for cmd in (cfg, ["cmake", "--build", str(bdir), "-j", "16"]):
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(
                f"{' '.join(cmd[:2])} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
            )
        if "CUDA kernels enabled" in out.stdout:
            print("   CUDA kernels enabled")
    lib = bdir / "libort_lora_ops.so"
    os.environ["ORT_LORA_LIBRARY"] = str(lib)
    return {"library": str(lib)}


@section("cpu_ops")
def cpu_ops(args) -> dict:
    import onnxruntime as ort

    import ort_lora

    ort_lora.session_options()  # registers the library: fails if it does not load
    return {"onnxruntime": ort.__version__, "providers": ort.get_available_providers()}


def _kernel_case(rt, dtype, ranks, lengths, rng):
    from ort_lora.ops.lora_sgmv_ref import lora_sgmv, place_random_adapters
    from ort_lora.runtime.cuda_sgmv import from_storage, lora_sgmv_numpy, to_storage

    def to(a):
        return to_storage(a, dtype)

    def back(a):
        return from_storage(a, dtype)

    in_f, out_f = 576, 1536
    placed = place_random_adapters(rng, ranks, in_f, out_f, page_shape=(16, 3, 64))
    slots = rng.integers(-1, len(ranks), len(lengths)).astype(np.int32)
    meta = {"seg_starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            "seg_slots": slots, "a_offsets": placed.a_offsets, "b_offsets": placed.b_offsets,
            "ranks": np.asarray([ranks], np.int32),
            "scales": rng.uniform(0.5, 2, (1, len(ranks))).astype(np.float32)}  # fmt: skip
    rows = int(sum(lengths))
    x = to(rng.standard_normal((rows, in_f)).astype(np.float32))
    y = to(rng.standard_normal((rows, out_f)).astype(np.float32))
    k, v = to(placed.key_cache), to(placed.value_cache)
    got = back(lora_sgmv_numpy(rt, dtype, y, x, k, v, meta, 0))
    want = lora_sgmv(back(y), back(x), back(k), back(v), *meta.values(), layer=0)
    return float(np.abs(got - want).max() / np.abs(want).max())


@section("kernel")
def kernel(args) -> dict:
    from ort_lora.runtime.cuda_pool import CudaRuntime

    rt = CudaRuntime()
    tol = {"float16": 1e-3 * 2, "bfloat16": 1e-2 * 2}
    layouts = {"decode": [1] * 64, "prefill": [300, 41, 7], "mixed": [1, 1, 2, 130, 1, 0, 17, 3],
               "identical": [256]}  # fmt: skip
    worst, failures = {}, []
    rng = np.random.default_rng(0)
    for dtype in ("float16", "bfloat16"):
        for ranks in ([8], [16, 64, 128], [4, 33, 512]):
            for name, lengths in layouts.items():
                err = _kernel_case(rt, dtype, ranks, lengths, rng)
                worst[dtype] = max(worst.get(dtype, 0.0), err)
                if not err <= tol[dtype]:
                    failures.append(f"{dtype} ranks={ranks} {name}: rel err {err:.2e}")
    if failures:
        raise AssertionError("; ".join(failures))
    return {"worst_rel_err": worst}


@section("errors")
def errors(args) -> dict:
    from ort_lora.runtime.cuda_pool import CudaRuntime
    from ort_lora.runtime.cuda_sgmv import lora_sgmv_numpy

    rt = CudaRuntime()
    x = np.ones((2, 8), np.float16)
    meta = {"seg_starts": np.array([0, 2], np.int32), "seg_slots": np.array([0], np.int32),
            "a_offsets": np.array([[10**12]]), "b_offsets": np.array([[0]]),
            "ranks": np.array([[1]], np.int32),
            "scales": np.array([[1.0]], np.float32)}  # fmt: skip
    try:
        lora_sgmv_numpy(rt, "float16", x, x, np.zeros((1, 4, 1, 8), np.float16),
                        np.zeros((1, 4, 1, 8), np.float16), meta, 0)  # fmt: skip
    except ValueError as e:
        return {"message": str(e)}
    raise AssertionError("a bad offset was accepted")


@section("pool")
def pool(args) -> dict:
    import ctypes

    from ort_lora.adapters.layout import write_to_pool
    from ort_lora.runtime.cuda_pool import CudaPool, CudaRuntime

    sys.path.insert(0, str(ROOT / "tests"))
    from test_cuda_pool import manifest, random_adapter

    rt, m, num_pages = CudaRuntime(), manifest(block=16), 40
    p = CudaPool(m, num_pages, rt)
    rng = np.random.default_rng(1)
    expected = np.zeros((m.num_layers, 2, num_pages, 16, m.num_kv_heads, m.head_dim), np.float16)
    for aid, pages in ((1, [5, 6, 7]), (2, [30, 2, 3]), (3, [11])):
        adapter = random_adapter(rng, m)
        write_to_pool(adapter, pages, expected)
        p.load(
            aid, pages, lambda staging, a=adapter, n=len(pages): write_to_pool(a, range(n), staging)
        )  # noqa: E501
    waited = len(p.tracker.inflight)  # none is a prefetch: the next step waits for all
    p.wait_for_step()
    p.synchronize()
    got = np.empty_like(expected)
    rt.call("memcpy_async", got.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(p.base),
            ctypes.c_uint64(got.nbytes), 2, ctypes.c_void_p(0))  # fmt: skip
    rt.call("stream_synchronize", ctypes.c_void_p(0))
    np.testing.assert_array_equal(got, expected)
    return {"events_waited": waited, "inflight_after_sync": len(p.tracker.inflight)}


@section("timing")
def timing(args) -> dict:
    import torch

    from ort_lora.runtime.cuda_pool import CudaRuntime
    from ort_lora.runtime.cuda_sgmv import lora_sgmv_ptrs

    rt, dev, out = CudaRuntime(), torch.device("cuda"), {}
    hidden, rank, num_adapters = 4096, 16, 8
    for name, rows, seg in (("decode_64", 64, 1), ("prefill_4096", 4096, 512)):
        s = rows // seg
        # rows of A and B^T back to back in one pool: adapter a's A rows, then its B^T rows
        pool = torch.randn(2 * num_adapters * rank * hidden, device=dev, dtype=torch.float16) * 0.02  # noqa: E501
        half = pool.numel() // 2
        base = np.arange(num_adapters)[:, None] * 2 * rank * hidden
        a_off = (base + np.arange(rank)[None] * hidden).astype(np.int64)
        b_off = (a_off + rank * hidden).astype(np.int64)
        meta = {"seg_starts": np.arange(0, rows + 1, seg, dtype=np.int32),
                "seg_slots": (np.arange(s) % num_adapters).astype(np.int32),
                "a_offsets": a_off, "b_offsets": b_off,
                "ranks": np.full((1, num_adapters), rank, np.int32),
                "scales": np.ones((1, num_adapters), np.float32)}  # fmt: skip
        x = torch.randn(rows, hidden, device=dev, dtype=torch.float16)
        y = torch.randn(rows, hidden, device=dev, dtype=torch.float16)
        y_out = torch.empty_like(y)
        stream = torch.cuda.current_stream().cuda_stream

        def sgmv():
            lora_sgmv_ptrs(rt, "float16", x.data_ptr(), y.data_ptr(), y_out.data_ptr(),
                           pool.data_ptr(), pool.data_ptr() + 2 * half, half, meta, 0, rows,
                           hidden, hidden, stream)  # fmt: skip

        wa = torch.randn(hidden, rank, device=dev, dtype=torch.float16)
        wb = torch.randn(rank, hidden, device=dev, dtype=torch.float16)

        def dense():  # same FLOPs, one adapter's weights already gathered: cuBLAS
            torch.addmm(y, x @ wa, wb)

        t_sgmv, t_dense = _time(sgmv), _time(dense)
        # the target: SGMV at >= 50% of the dense matmul's FLOP rate
        out[name] = {"sgmv_us": t_sgmv, "dense_cublas_us": t_dense,
                     "rate_vs_dense": round(t_dense / t_sgmv, 3)}  # fmt: skip
    return out


def _time(fn, reps: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1000 / reps, 1)


@section("e2e")
def e2e(args) -> dict:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Skipped(
            f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
            "(needs onnxruntime-gpu); end-to-end CUDA graph not checked"
        )
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="ort_lora_e2e_"))
    cpu, gpu, adapters = _e2e_models(work)
    out = {"session_logits_rel_err": _e2e_session(cpu, gpu)}
    out.update(_e2e_engine(cpu, gpu, adapters))
    return out


def _e2e_models(work: Path):
    """A random small Llama (HF format), its cpu and cuda exports, and 4 random PEFT adapters."""
    import peft
    import transformers

    from ort_lora.export import export_model
    from ort_lora.export.tiny import tiny_config, write_random_checkpoint

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32)  # fmt: skip
    ckpt = write_random_checkpoint(work / "ckpt", cfg, seed=1)
    cpu = export_model(ckpt, work / "cpu", block_size=16, progress=False)
    gpu = export_model(ckpt, work / "cuda", block_size=16, device="cuda", dtype="float16",
                       progress=False)  # fmt: skip
    adapters = []
    for i, rank in enumerate((4, 8, 16, 32)):
        base = transformers.LlamaForCausalLM.from_pretrained(ckpt)
        targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
        lcfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                               target_modules=targets)  # fmt: skip
        peft.get_peft_model(base, lcfg).save_pretrained(work / f"lora{i}")
        adapters.append(work / f"lora{i}")
    return cpu, gpu, adapters


def _e2e_session(cpu: Path, gpu: Path) -> list[float]:
    """Base-model logits, CPU float32 vs CUDA float16: a prefill, then 4 decode steps (this
    also checks that PagedAttention's KV writes reach the bound device pool)."""
    from ort_lora.engine.model_runner import ModelRunner
    from ort_lora.engine.step_plan import base_plan
    from ort_lora.runtime.session import ModelSession

    r_cpu, r_gpu = (
        ModelRunner(ModelSession(cpu, 8)),
        ModelRunner(ModelSession(gpu, 8, device="cuda")),
    )
    tokens = list(np.random.default_rng(2).integers(3, 250, 21))
    past, errs = 0, []
    new = tokens
    for _ in range(5):
        plan = base_plan((new, past, [0, 1, 2, 3]), block_size=r_cpu.block_size)
        a, b = r_cpu.run(plan), r_gpu.run(plan)
        errs.append(round(float(np.abs(a - b).max() / np.abs(a).max()), 5))
        past += len(new)
        new = [int(a[-1].argmax())]
    if max(errs) > 3e-2:
        raise AssertionError(f"CUDA logits differ from CPU: relative errors per step {errs}")
    return errs


def _e2e_engine(cpu: Path, gpu: Path, adapters: list[Path]) -> dict:
    """Greedy tokens CPU vs CUDA with mixed adapters; CUDA throughput mixed vs base-only."""
    from ort_lora import LLM, LoRARequest, SamplingParams

    loras = [LoRARequest(f"l{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, 12)] for _ in range(8)]
    mix = [loras[i % 4] if i % 5 else None for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for device, model in (("cpu", cpu), ("cuda", gpu)):
        outs = LLM(model, device=device).generate(prompts, greedy, lora_request=mix)
        runs[device] = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for x, y in zip(runs["cpu"], runs["cuda"]) for a, b in zip(x, y))
    out = {"greedy_token_agreement": round(same / (8 * len(prompts)), 3)}
    llm = LLM(gpu, device="cuda")
    many = [[int(t) for t in rng.integers(3, 250, 64)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for name, lora in (
        ("base_only", None),
        ("identical_adapter", [loras[0]] * 64),
        ("mixed_4_adapters", [loras[i % 4] for i in range(64)]),
    ):
        t0 = time.perf_counter()
        llm.generate(many, params, lora_request=lora)
        out[f"{name}_tok_per_s"] = round(64 * 32 / (time.perf_counter() - t0), 1)
    for name in ("identical_adapter", "mixed_4_adapters"):  # target: identical cost < 15%
        cost = 1 - out[f"{name}_tok_per_s"] / out["base_only_tok_per_s"]
        out[f"{name}_lora_cost"] = round(cost, 3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "results" / "gpu_check.json"))
    p.add_argument("--ort-include", default=os.environ.get("ORT_INCLUDE_DIR", ""))
    p.add_argument("--build-dir", default="/tmp/ort_lora_gpu_build")
    args = p.parse_args()
    for fn in (build, cpu_ops, kernel, errors, pool, timing, e2e):
        fn(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=2, default=str) + "\n")
    print(f"\n{'section':<10} {'status':<8} {'s':>6}  detail")
    for name, r in RESULTS.items():
        detail = {k: v for k, v in r.items() if k not in ("status", "seconds")}
        text = json.dumps(detail, default=str)[:150]
        print(f"{name:<10} {r['status']:<8} {r['seconds']:>6}  {text}")
    print(f"wrote {args.out}")
    return 0 if all(r["status"] != "FAILED" for r in RESULTS.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
