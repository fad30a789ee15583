"""Metrics of one benchmark run, computed the same way for every system from token times.

Every system runner returns, per request, its arrival time and the wall time at which each of
its output tokens became available (seconds from the start of the run). From those:
    output_tok_s   output tokens / (last token time)     requests_s   requests / the same
    ttft_*         first token time - arrival            itl_*        gaps between tokens
Percentiles are p50, p90, p99.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimes:
    """One request: arrival and the times its output tokens appeared (seconds from start)."""

    arrival_s: float
    token_s: list[float] = field(default_factory=list)


def summarize(times: list[RequestTimes], expected_tokens: int | tuple[int, int]) -> dict:
    """Throughput and latency of a run; ValueError if the token count is not the expected one,
    or outside the expected (low, high) range (a system that stopped early or ran on would
    make the comparison meaningless)."""
    produced = sum(len(t.token_s) for t in times)
    low, high = (expected_tokens,) * 2 if isinstance(expected_tokens, int) else expected_tokens
    if not low <= produced <= high:
        raise ValueError(f"the run produced {produced} output tokens; expected {expected_tokens}")
    end = max(t.token_s[-1] for t in times if t.token_s)
    ttft = [t.token_s[0] - t.arrival_s for t in times]
    itl = np.concatenate([np.diff(t.token_s) for t in times if len(t.token_s) > 1] or [[]])
    out = {
        "duration_s": end,
        "output_tokens": produced,
        "output_tok_s": produced / end,
        "requests_s": len(times) / end,
    }
    out.update(_percentiles("ttft", np.asarray(ttft)))
    out.update(_percentiles("itl", itl))
    return out


def _percentiles(name: str, values: np.ndarray) -> dict:
    if values.size == 0:
        return {f"{name}_p{p}_ms": None for p in PERCENTILES}
    return {f"{name}_p{p}_ms": float(np.percentile(values, p) * 1e3) for p in PERCENTILES}


def peak_rss_mb(pid: int | str = "self", key: str = "VmHWM") -> float | None:
    """Peak resident memory (VmHWM; key="VmRSS": the current one) of a process in MiB, from
    /proc; None where unavailable.

    Not ru_maxrss: after fork + exec it still holds the parent's peak at fork time."""
    from pathlib import Path

    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_tree(pid: int) -> list[int]:
    """pid and its live descendants (from /proc; a server that forks workers, like vLLM's
    engine core, is measured as the whole tree)."""
    from pathlib import Path

    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(parents.get(p, []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its live descendants (all threads)."""
    import os
    from pathlib import Path

    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def tree_peak_rss_mb(pid: int, key: str = "VmHWM") -> float | None:
    """Summed VmHWM (or `key`) of a process and its live descendants in MiB (an upper bound
    on their joint peak: each one's own peak, whenever it came)."""
    peaks = [peak_rss_mb(p, key) for p in process_tree(pid)]
    return sum(p for p in peaks if p is not None) or None


def sgemm_gflops(n: int = 2048, repeats: int = 3) -> float:
    """float32 GEMM rate of numpy's BLAS on an n x n x n product: the machine's compute roof."""
    import time

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up threads and caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9
