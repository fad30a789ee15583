"""Hugging Face Optimum on the same checkpoint and PEFT adapters, from its own venv (peers.py
creates it under the bench cache directory): the route an ONNX Runtime user with LoRA
adapters has without ort-lora.

optimum: each adapter merged into the base (PEFT `merge_and_unload`) and the merged model
         exported by Optimum (`ORTModelForCausalLM.from_pretrained(dir, export=True)`, with
         past KV), one export per adapter (and one of the base), all loaded at once. ONNX
         Runtime runs one set of weights per session, so requests are grouped by adapter and
         each group runs as one greedy batch (`generate`), the groups one after another, like
         genai-multilora's.
The exports (minutes each) are made before any run (`prepare`, from `ort-lora bench`) and kept
in <cache>/<model>/optimum_exports, named by a hash of the adapter's files; the child makes any
that are missing before measuring, untimed either way. CPU time and peak memory are those of
the child's process tree while it serves.
"""

from __future__ import annotations

import os
from pathlib import Path

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.peers import run_child
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import Workload

CHILD = Path(__file__).with_name("optimum_child.py")


def export_dir(hf: str | Path) -> Path:
    """Where the merged exports of a checkpoint's adapters live: beside the checkpoint."""
    return Path(hf).parent / "optimum_exports"


def optimum_env(threads: int) -> dict:
    """The child's environment: local files only, `threads` OpenMP threads (torch's part of
    generate), and none of ort-lora's PYTHONPATH."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)
    return env


def build_job(spec: RunSpec, workload: Workload) -> dict:
    return {
        "model": spec.models["hf"],
        "adapters": spec.adapters[: workload.num_adapters],
        "requests": workload.to_json()["requests"],
        "export_dir": str(export_dir(spec.models["hf"])),
        "threads": spec.threads,
    }


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    out = _child(spec.models["optimum_python"], [], build_job(spec, workload), spec.threads)
    times = [RequestTimes(r.arrival_s, t) for r, t in zip(workload.requests, out["token_s"])]
    extra = {"cpu_s": out["cpu_s"], "server_peak_rss_mb": out["peak_rss_mb"]}
    extra.update(optimum_version=out["version"], ort_version=out["ort_version"])
    extra.update(groups=out["groups"], **({"export_s": out["export_s"]} if out["export_s"] else {}))
    return times, extra


def prepare(python: str | Path, hf: str | Path, adapters: list, threads: int) -> dict:
    """Make the base's and every adapter's export that is missing; {name: seconds} of those
    made. RuntimeError if the child fails."""
    job = {
        "model": str(hf),
        "export_dir": str(export_dir(hf)),
        "exports": [None, *map(str, adapters)],
    }
    return _child(python, ["--export"], job, threads)["export_s"]


def _child(python, flags: list[str], job: dict, threads: int) -> dict:
    """Run optimum_child.py on `job` in the venv's python; its OUT json."""
    return run_child(python, CHILD, flags, job, optimum_env(threads))
