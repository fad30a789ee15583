"""The `cluster` experiment of `ort-lora bench`: S-LoRA's trace over many adapters through
`ort-lora serve --ray` on a local Ray cluster (systems/ray_cluster.py), with Ray Serve's
multiplexing routing each adapter's requests to replicas that hold it, then with Ray's
default power-of-two routing. Its report section and plot, and what the figures say about
more machines.

On one machine the replicas share its cores, so throughput cannot grow with them; the
projection takes the measured CPU cost of each part: engine CPU-seconds per output token
(the replicas) and per request (ingress + proxy), and assumes a replica per core-group on
each machine, one proxy per node (Ray Serve's default) and ingress replicas added as needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ort_lora.bench import plots, report

SYSTEM = "ort-lora-ray"
EXPERIMENT = "cluster"


def unavailable() -> str | None:
    """Why the cluster system cannot run here (None: it can)."""
    if importlib.util.find_spec("ray") is None:
        return "ort-lora-ray (cluster) skipped: ray is not installed (pip install -e '.[ray]')"
    return None


def _cost(row: dict) -> dict[str, float]:
    """CPU-milliseconds per output token (replicas) and per request (ingress, proxy, Ray)."""
    cpu, extra = row["extra"]["cpu_by_component"], row["extra"]
    n = extra["adapter_requests"] or 1
    return {
        "engine_ms_per_token": 1e3 * cpu.get("replicas", 0.0) / row["output_tokens"],
        "front_ms_per_request": 1e3 * (cpu.get("ingress", 0.0) + cpu.get("proxy", 0.0)) / n,
        "ray_ms_per_request": 1e3 * cpu.get("ray", 0.0) / n,
    }


def markdown(rows: list[dict]) -> list[str]:
    """The report's section: the standard table, the adapter figures, the projection."""
    if not rows:
        return []
    ok = [r for r in rows if "error" not in r]
    lines = [f"## {EXPERIMENT}", "", report.table(rows), ""]
    if not ok:
        return lines
    head = "| routing | registrations / request | pool loads / request | hit rate | "
    head += "replicas / adapter | requests per replica | engine CPU ms / token | "
    head += "ingress + proxy CPU ms / request | Ray CPU ms / request |"
    lines += [head, "|" + "---|" * 9]
    for r in ok:
        e, c = r["extra"], _cost(r)
        lines.append(
            f"| {e['routing']} | {e['registrations_per_request']:.3f} | "
            f"{e['pool_loads_per_request']:.3f} | {e['hit_rate']:.3f} | "
            f"{e['replicas_per_adapter']:.2f} | {e['requests_per_replica']} | "
            f"{c['engine_ms_per_token']:.2f} | {c['front_ms_per_request']:.1f} | "
            f"{c['ray_ms_per_request']:.1f} |"
        )
    lines += [""] + _comparison(ok) + [""] + projection(ok) + [""]
    return lines


def _comparison(rows: list[dict]) -> list[str]:
    by = {r["extra"]["routing"]: r for r in rows}
    if not {"adapter", "default"} <= set(by):
        return []
    a, d = by["adapter"], by["default"]
    fewer = d["extra"]["registrations_per_request"] / max(
        a["extra"]["registrations_per_request"], 1e-9
    )
    return [
        f"Adapter routing registers {fewer:.1f}x fewer adapters per request than Ray's "
        f"default routing (target >= 3x); TTFT p99 {a['ttft_p99_ms']:.0f} ms vs "
        f"{d['ttft_p99_ms']:.0f} ms; {a['output_tok_s']:.1f} vs {d['output_tok_s']:.1f} "
        "output tok/s."
    ]


def projection(rows: list[dict], machines=(1, 2, 4, 8), cores: int = 8) -> list[str]:
    """Throughput on more machines from the measured CPU costs of the adapter-routing run."""
    row = next((r for r in rows if r["extra"]["routing"] == "adapter"), rows[0])
    c = _cost(row)
    per_request_tokens = row["output_tokens"] / max(row["extra"]["adapter_requests"], 1)
    front = (c["front_ms_per_request"] + c["ray_ms_per_request"]) / per_request_tokens
    per_core = 1e3 / (c["engine_ms_per_token"] + front)  # output tok/s one core sustains
    cells = " | ".join(f"{m * cores * per_core:.0f}" for m in machines)
    return [
        f"How it would scale (from the adapter-routing run's CPU costs): a core sustains "
        f"{1e3 / c['engine_ms_per_token']:.0f} output tok/s of engine work; the ingress and "
        f"proxy add {c['front_ms_per_request']:.1f} CPU-ms and Ray's own processes "
        f"{c['ray_ms_per_request']:.1f} CPU-ms per request ({front:.2f} ms per output token "
        f"at {per_request_tokens:.0f} tokens a request). Replicas share nothing but the "
        "proxy, so N machines of C cores give about N x C x that rate, as long as each "
        "adapter's requests fit its replicas (adapter routing keeps them there), and the "
        "ingress is scaled out (one ingress replica per few nodes) once its per-request cost "
        "nears a core:",
        "",
        "| machines (x " + f"{cores} cores) | " + " | ".join(map(str, machines)) + " |",
        "|---|" + "---|" * len(machines),
        f"| projected output tok/s | {cells} |",
    ]


def plots_of(rows: list[dict], out: Path) -> list[Path]:
    """Registrations per request and TTFT p99 of each routing (nothing without rows)."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return []
    flat = [{**r, **{k: r["extra"][k] for k in ("registrations_per_request",)}} for r in ok]
    title = "cluster: adapter registrations per request"
    loads = out / "cluster_loads.png"
    return [
        plots.bar_plot(flat, "registrations_per_request", title, "per request", loads),
        plots.latency_plot(ok, out / "cluster_latency.png"),
    ]
