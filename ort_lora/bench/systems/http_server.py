"""ort-lora through its OpenAI-compatible HTTP server: `ort-lora serve` in a child process,
requests sent at their arrival times as streaming /v1/completions calls (token-id prompts,
greedy, ignore_eos). Token times are the arrival times of the SSE chunks at the client; each
chunk's token count comes from its logprobs. Peak memory is the server's (VmHWM)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from ort_lora.bench.metrics import RequestTimes, peak_rss_mb
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import BenchRequest, Workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(spec: RunSpec, workload: Workload, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ort_lora.cli", "serve", spec.models["ort_lora"]]
    cmd += ["--port", str(port), "--log-level", "warning", "--max-loras", "32"]
    cmd += ["--max-cpu-loras", "48", "--max-num-seqs", "64", "--pool-memory-mb", "1536"]
    mods = [f"a{i}={spec.adapters[i]}" for i in range(workload.num_adapters)]
    if mods:
        cmd += ["--lora-modules", *mods]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ort-lora serve exited ({proc.returncode}): {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"ort-lora serve did not answer {url}/health within {timeout_s}s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads), from /proc."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(spec, workload, port)
    try:
        _wait_healthy(proc, url)
        warm = BenchRequest((100, 101, 102, 103), 2, None)
        asyncio.run(_send_all(url, [warm]))
        cpu0 = cpu_seconds(proc.pid)
        times = asyncio.run(_send_all(url, list(workload.requests)))
        extra = {"cpu_s": cpu_seconds(proc.pid) - cpu0}
        return times, {**extra, "server_peak_rss_mb": peak_rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _send_all(url: str, requests: list[BenchRequest]) -> list[RequestTimes]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        jobs = [_one(client, r, t0) for r in requests]
        return list(await asyncio.gather(*jobs))


async def _one(client, r: BenchRequest, t0: float) -> RequestTimes:
    await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
    body = {
        "model": "base" if r.adapter is None else f"a{r.adapter}",
        "prompt": list(r.prompt_ids),
        "max_tokens": r.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }
    if r.adapter is None:
        body.pop("model")
    times = RequestTimes(r.arrival_s)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"POST /v1/completions: {resp.status_code} {await resp.aread()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            times.token_s.extend([time.perf_counter() - t0] * n)
    return times
