"""ort-lora on a Ray cluster: `ort-lora serve --ray` with spec.options["replicas"] replicas on a
head node started on this machine (bench/harness/ray_cluster.py: 127.0.0.1 only, all the
machine's CPUs), requests sent at their arrival times through Ray Serve's HTTP proxy as the
HTTP system sends them (streaming /v1/completions, greedy, ignore_eos).

spec.options: routing ("adapter": Ray Serve multiplexing by adapter name; "default": Ray's
power-of-two routing), replicas, max_adapters_per_replica, pool_mb (each replica's pool).

Extra: adapter registrations in a replica (Ray's multiplexed loads) and pool loads per
request, the hit rate (requests that found their adapter registered on their replica),
replicas per adapter, requests per replica, and CPU seconds by component (the replicas, the
ingress, the HTTP proxy, Ray's own processes) from /proc, for the whole cluster's process
tree; cpu_s is all of it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ort_lora.bench.metrics import RequestTimes, process_tree, tree_peak_rss_mb
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems.http_server import _send_all
from ort_lora.bench.workloads import BenchRequest, Workload

# process title (Ray sets "ray::<actor>") -> component
COMPONENTS = (("LoraReplica", "replicas"), ("LoraIngress", "ingress"), ("ProxyActor", "proxy"))


def serve_args(spec: RunSpec, workload: Workload) -> list[str]:
    o = spec.options
    adapters = [f"a{i}={a}" for i, a in enumerate(spec.adapters[: workload.num_adapters])]
    return [
        spec.models["ort_lora"],
        "--num-replicas",
        str(o["replicas"]),
        "--max-adapters-per-replica",
        str(o["max_adapters_per_replica"]),
        "--replica-cpus",
        str(spec.threads / o["replicas"]),
        "--ray-routing",
        o["routing"],
        "--pool-memory-mb",
        str(o["pool_mb"]),
        "--max-num-seqs",
        "64",
        "--max-ongoing-requests",
        str(o.get("max_ongoing_requests", 64)),
        "--log-level",
        "warning",
        "--lora-modules",
        *adapters,
    ]


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    from ort_lora.bench.harness.ray_cluster import LocalRayCluster

    cpus = max(spec.threads, os.cpu_count() or 1)
    cluster = LocalRayCluster(num_cpus=cpus, lifetime_s=3600)
    with cluster, cluster.serve(serve_args(spec, workload), startup_timeout_s=600) as url:
        root = cluster.proc.pid
        asyncio.run(_send_all(url, [BenchRequest((100, 101, 102, 103), 2, None)]))
        cpu0 = cpu_by_component(root)
        times = asyncio.run(_send_all(url, list(workload.requests)))
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_by_component(root).items()}
        time.sleep(2.5)  # the replicas' next reports (every second) hold every request
        extra = adapter_figures(url, len(workload.requests))
        extra["server_steady_rss_mb"] = tree_peak_rss_mb(root, "VmRSS")
        extra["server_peak_rss_mb"] = tree_peak_rss_mb(root)
    extra.update(cpu_s=sum(cpu.values()), cpu_by_component=cpu, **spec.options)
    return times, extra


def cpu_by_component(root: int) -> dict[str, float]:
    """User + system CPU seconds of each live process under `root`, summed by component."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in process_tree(root):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        part = next((c for key, c in COMPONENTS if key in title), "ray")
        out[part] = out.get(part, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def adapter_figures(url: str, num_requests: int) -> dict:
    """The cluster's adapter figures from its /metrics, per request."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def total(name: str, **labels) -> float:
        return sum(
            s.value
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    hits = total("ort_lora:cluster_adapter_requests_total", result="hit")
    misses = total("ort_lora:cluster_adapter_requests_total", result="miss")
    served = [s for s in samples if s.name == "ort_lora:cluster_adapter_requests_total"]
    per_adapter: dict[str, set] = {}
    per_replica: dict[str, float] = {}
    for s in served:
        if s.value:
            per_adapter.setdefault(s.labels["lora_name"], set()).add(s.labels["replica"])
            per_replica[s.labels["replica"]] = per_replica.get(s.labels["replica"], 0) + s.value
    registrations = total("ort_lora:cluster_adapter_loads_total")
    return {
        "adapter_requests": hits + misses,
        "registrations": registrations,
        "registrations_per_request": registrations / num_requests,
        "pool_loads_per_request": total("ort_lora:lora_loads_total") / num_requests,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "replicas_per_adapter": sum(map(len, per_adapter.values())) / max(1, len(per_adapter)),
        "requests_per_replica": sorted(per_replica.values()),
    }
