"""ort-lora through its OpenAI-compatible HTTP server: `ort-lora serve` in a child process,
requests sent at their arrival times as streaming /v1/completions calls (token-id prompts,
greedy, ignore_eos). Token times are the arrival times of the SSE chunks at the client; each
chunk's token count comes from its logprobs (or, from llama-server, from the growth of the
chunk's timings.predicted_n). CPU time and peak memory are the server's (its whole process
tree). `measure_server` is shared with vLLM's server (vllm_peer.py) and llama.cpp's
(llama_cpp.py). A spec with options["sequential"] sends its requests one at a time, each
when the one before it has ended (its arrival time: when it was sent)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ort_lora.bench.metrics import RequestTimes, cpu_seconds, tree_peak_rss_mb
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import BenchRequest, Workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    model_dir: str,
    port: int,
    adapters: list[str],
    preload: bool = True,
    pool_bytes: int | None = None,
) -> list[str]:
    """`ort-lora serve` with its default pool (or one of pool_bytes), max_loras and host adapter
    cache, adapters named a0, a1, ... (preload False: --no-preload-adapters)."""
    cmd = [sys.executable, "-m", "ort_lora.cli", "serve", model_dir, "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-num-seqs", "64"]
    cmd += [] if preload else ["--no-preload-adapters"]
    cmd += [] if pool_bytes is None else ["--pool-memory-mb", str(pool_bytes >> 20)]
    if adapters:
        cmd += ["--lora-modules", *[f"a{i}={a}" for i, a in enumerate(adapters)]]
    return cmd


def start_server(spec: RunSpec, workload: Workload, port: int) -> subprocess.Popen:
    model = spec.models[spec.options.get("model", "ort_lora")]
    preload = spec.options.get("preload_adapters", True)
    pool = spec.options.get("pool_bytes")
    cmd = serve_command(model, port, spec.adapters[: workload.num_adapters], preload, pool)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def pool_and_model_mb(url: str, model_dir: str) -> dict:
    """The server's pool (pages from /metrics x the model's page size) and the model's bytes
    on disk (graph + external weights), in MiB."""
    import httpx

    from ort_lora.config import page_bytes
    from ort_lora.contract import ModelManifest

    text = httpx.get(f"{url}/metrics", timeout=10).text
    pages = sum(
        float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("ort_lora:pool_pages{")
    )
    model = sum(f.stat().st_size for f in Path(model_dir).glob("model.onnx*"))
    pool = pages * page_bytes(ModelManifest.load(model_dir))
    return {"pool_mb": pool / 2**20, "model_mb": model / 2**20}


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = proc.stderr.read() if proc.stderr else "its output is in bench.log"
            raise RuntimeError(f"the server exited ({proc.returncode}): {said}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server did not answer {url}/health within {timeout_s}s")


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(spec, workload, port)
    sizes = {}
    times, extra = measure_server(
        proc,
        url,
        workload,
        before_stop=lambda: sizes.update(
            pool_and_model_mb(url, spec.models[spec.options.get("model", "ort_lora")])
        ),
        sequential=spec.options.get("sequential", False),
    )
    return times, {**extra, **sizes}


# a request's body fields that differ from the default ones (None: the field is left out)
Fields = Callable[[BenchRequest], dict]


def measure_server(
    proc,
    url: str,
    workload: Workload,
    base_model=None,
    before_stop=None,
    fields: Fields | None = None,
    sequential: bool = False,
):
    """Wait for the server, warm it up, send the workload; (times, extra with cpu_s and the
    server's peak RSS). Calls before_stop(), then stops the server. base_model: the `model`
    of base-only requests (None: no `model` field); fields: each request's own body fields
    over the default ones; sequential: one request at a time."""
    try:
        wait_healthy(proc, url)
        warm = BenchRequest((100, 101, 102, 103), 2, None)
        asyncio.run(_send_all(url, [warm], base_model, fields))
        cpu0 = cpu_seconds(proc.pid)
        requests = list(workload.requests)
        times = asyncio.run(_send_all(url, requests, base_model, fields, sequential))
        extra = {"cpu_s": cpu_seconds(proc.pid) - cpu0}
        if before_stop is not None:
            before_stop()
        extra["server_steady_rss_mb"] = tree_peak_rss_mb(proc.pid, "VmRSS")
        return times, {**extra, "server_peak_rss_mb": tree_peak_rss_mb(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


async def _send_all(
    url: str, requests: list[BenchRequest], base_model=None, fields=None, sequential=False
):
    import httpx

    # a fresh connection per request: reusing one that llama-server's HTTP library is closing
    # ends the next request with "Server disconnected" (one request at a time)
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        if sequential:  # each sent when the one before it has ended
            out = []
            for r in requests:
                sent = replace(r, arrival_s=time.perf_counter() - t0)
                out.append(await _one(client, sent, t0, base_model, fields))
            return out
        jobs = [_one(client, r, t0, base_model, fields) for r in requests]
        return list(await asyncio.gather(*jobs))


async def _one(
    client, r: BenchRequest, t0: float, base_model: str | None, fields: Fields | None = None
) -> RequestTimes:
    await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
    body = {
        "model": base_model if r.adapter is None else f"a{r.adapter}",
        "prompt": list(r.prompt_ids),
        "max_tokens": r.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        **(fields(r) if fields is not None else {}),
    }
    body = {k: v for k, v in body.items() if v is not None}
    times, counted = RequestTimes(r.arrival_s), 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"POST /v1/completions: {resp.status_code} {await resp.aread()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n = chunk_tokens(json.loads(line[6:]), counted)
            counted += n
            times.token_s.extend([time.perf_counter() - t0] * n)
    return times


def chunk_tokens(chunk: dict, counted: int) -> int:
    """The output tokens a streamed chunk carries: its logprobs' tokens, or, where it has
    timings (llama-server's timings_per_token), their count so far less `counted`."""
    if "timings" in chunk:
        return chunk["timings"]["predicted_n"] - counted
    choice = (chunk.get("choices") or [{}])[0]
    return len((choice.get("logprobs") or {}).get("tokens") or [])
