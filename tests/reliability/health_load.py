"""/health latency under mixed hostile + normal load: a runnable program, not a test.

    python tests/reliability/health_load.py [--seconds 20] [--model-dir DIR] [--out FILE]

Starts `ort-lora serve` in its own process (default: the tiny random Llama, exported to a
temporary directory), sends the requests that once froze every route (hostile_bodies.py)
from some threads and ordinary completions from others for --seconds, polls /health
meanwhile, and prints and saves its p50/p99/max latency (docs/reliability/health_load.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from hostile_bodies import CMPL, NORMAL, HealthPoller, hostile_bodies  # noqa: E402

from ort_lora.bench.harness.servers import ServeProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "docs" / "reliability" / "health_load.json"


def tiny_model(workdir: Path) -> Path:
    """The test suite's tiny random Llama, exported (needs torch, as the tests do)."""
    from ort_lora.export import export_model
    from ort_lora.export.tiny import tiny_config, write_random_checkpoint

    checkpoint = write_random_checkpoint(workdir / "ckpt", tiny_config("llama"), seed=1234)
    return export_model(checkpoint, workdir / "model", block_size=8, progress=False)


def sender(url: str, jobs: list[tuple[str, str, bytes]], stop: threading.Event, tally: Counter):
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=120) as client:
        i = 0
        while not stop.is_set():
            name, path, body = jobs[i % len(jobs)]
            try:
                status = client.post(url + path, content=body, headers=headers).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            tally[f"{name}: {status}"] += 1
            i += 1


def run_load(url: str, seconds: float, hostile_threads: int, normal_threads: int) -> dict:
    hostile = [(name, path, body) for name, path, body, _ in hostile_bodies()]
    normal = [("normal completion", CMPL, NORMAL)]
    stop, tally = threading.Event(), Counter()
    threads = [
        threading.Thread(target=sender, args=(url, jobs, stop, tally), daemon=True)
        for jobs in [hostile] * hostile_threads + [normal] * normal_threads
    ]
    with HealthPoller(url) as poller:
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(180)
    return {"health": poller.summary(), "requests": dict(sorted(tally.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="load duration")
    p.add_argument("--model-dir", type=Path, help="an exported model (default: tiny Llama)")
    p.add_argument("--hostile-threads", type=int, default=2)
    p.add_argument("--normal-threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to save the figures")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_dir or tiny_model(Path(tmp))
        serve = [str(model), "--max-model-len", "64", "--num-pages", "128"]
        serve += ["--log-level", "warning"]
        with ServeProcess(serve, env={"TOKENIZERS_PARALLELISM": "false"}) as url:
            result = run_load(url, args.seconds, args.hostile_threads, args.normal_threads)
    result["config"] = {
        "seconds": args.seconds, "hostile_threads": args.hostile_threads,
        "normal_threads": args.normal_threads, "model": "tiny llama" if not args.model_dir
        else str(args.model_dir), "cpus": os.cpu_count(), "python": platform.python_version(),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
