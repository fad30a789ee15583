"""/metrics of `ort-lora serve --ray`: one Prometheus page for the whole cluster.

    ort_lora:<the ingress's request metrics>    TTFT, ITL, e2e, tokens, finished requests,
                                                observed where the HTTP requests are served
    ort_lora:<engine metrics>{replica="..."}    each replica's engine stats (server/metrics.py
                                                families: requests, pool pages, adapters)
    ort_lora:cluster_*                          affinity: per replica and adapter, requests
                                                that found it registered (hit) or not (miss),
                                                loads, evictions; hit rate; replicas per adapter
    ray_*                                       Ray's own metrics (Serve's included), read from
                                                every node's metrics agent at scrape time

The replicas' figures come from their reports to the adapter directory (ray/client.py keeps
the latest), so a scrape never waits for a replica.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ort_lora.server.metrics import PREFIX, EngineStatsCollector, ServerMetrics

logger = logging.getLogger("ort_lora.server")
RAY_SCRAPE_TIMEOUT_S = 2.0
_RESIDENCY_ORDER = ("none", "host", "device")
_EMPTY_STATS = {"running": 0, "waiting": 0, "preemptions": 0, "pool": {}, "adapters": {}}
_EMPTY_STATS |= {"prefix_cache": {}}
# the families EngineStatsCollector emits: shown per replica instead of once
ENGINE_FAMILIES = frozenset(f.name for f in EngineStatsCollector(lambda: _EMPTY_STATS).collect())


def cluster_totals(replicas: dict[str, dict]) -> dict:
    """The replicas' engine stats added up, in engine_stats()'s shape (an adapter's residency
    is the best of any replica's)."""
    out = {"running": 0, "waiting": 0, "preemptions": 0, "pool": {}, "adapters": {}}
    out["prefix_cache"] = {}
    for figures in replicas.values():
        stats = figures["stats"]
        for key in ("running", "waiting", "preemptions"):
            out[key] += stats[key]
        for part in ("pool", "prefix_cache"):
            for key, value in stats.get(part, {}).items():
                out[part][key] = out[part].get(key, 0) + value
        for name, info in stats["adapters"].items():
            total = out["adapters"].setdefault(name, {"resident": "none"})
            for key, value in info.items():
                if key == "resident":
                    best = max(total["resident"], value, key=_RESIDENCY_ORDER.index)
                    total["resident"] = best
                else:
                    total[key] = total.get(key, 0) + value
    return out


def per_replica_families(replicas: dict[str, dict]) -> list[Metric]:
    """EngineStatsCollector's families for every replica, labelled replica="<id>"."""
    merged: dict[str, Metric] = {}
    for replica, figures in sorted(replicas.items()):
        collector = EngineStatsCollector(lambda stats=figures["stats"]: stats)
        for family in collector.collect():
            _merge(merged, family, {"replica": replica})
    return list(merged.values())


def affinity_families(replicas: dict[str, dict]) -> list[Metric]:
    """Per replica and adapter: hits, misses, loads, evictions; the hit rate; replicas that
    hold each adapter now; each replica's process and node, and when its figures were taken."""
    labels = ["replica", "lora_name"]
    requests = CounterMetricFamily(
        PREFIX + "cluster_adapter_requests",
        "Adapter requests by replica: result=hit found it registered there, miss had to load it",
        labels=labels + ["result"],
    )
    loads = CounterMetricFamily(
        PREFIX + "cluster_adapter_loads", "Adapter registrations by replica", labels=labels
    )
    evictions = CounterMetricFamily(
        PREFIX + "cluster_adapter_evictions", "Adapter unregistrations by replica", labels=labels
    )
    held = GaugeMetricFamily(
        PREFIX + "cluster_adapter_replicas", "Replicas holding the adapter", labels=["lora_name"]
    )
    hits = misses = 0
    holders: dict[str, int] = {}
    for replica, figures in sorted(replicas.items()):
        for name, c in sorted(figures["adapters"].items()):
            requests.add_metric([replica, name, "hit"], c["hits"])
            requests.add_metric([replica, name, "miss"], c["misses"])
            loads.add_metric([replica, name], c["loads"])
            evictions.add_metric([replica, name], c["evictions"])
            hits, misses = hits + c["hits"], misses + c["misses"]
        for name in figures["held"]:
            holders[name] = holders.get(name, 0) + 1
    for name, count in sorted(holders.items()):
        held.add_metric([name], count)
    rate = GaugeMetricFamily(
        PREFIX + "cluster_adapter_hit_rate",
        "Share of adapter requests served by a replica that already had the adapter",
        value=hits / (hits + misses) if hits + misses else 0.0,
    )
    info = GaugeMetricFamily(
        PREFIX + "cluster_replica_info",
        "Replicas that reported lately: their process and node",
        labels=["replica", "pid", "node"],
    )
    reported = GaugeMetricFamily(
        PREFIX + "cluster_replica_report_timestamp_seconds",
        "When each replica took the figures of its latest report (Unix time): they count "
        "every request that reached it before then",
        labels=["replica"],
    )
    for replica, figures in sorted(replicas.items()):
        info.add_metric([replica, str(figures["pid"]), figures["node"]], 1)
        reported.add_metric([replica], figures["time"])
    return [requests, loads, evictions, held, rate, info, reported]


def merge_exposition(texts: list[str]) -> list[Metric]:
    """Prometheus text pages (one per node) as one list of families: a family several pages
    carry is shown once, with all their samples."""
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            _merge(merged, family, {})
    return list(merged.values())


def _merge(merged: dict[str, Metric], family: Metric, extra: dict[str, str]) -> None:
    into = merged.get(family.name)
    if into is None:
        into = merged[family.name] = Metric(family.name, family.documentation, family.type)
    into.samples.extend(s._replace(labels={**s.labels, **extra}) for s in family.samples)


class ClusterPage:
    """What one scrape shows (generate_latest reads any object with collect())."""

    def __init__(self, ingress_registry, replicas: dict[str, dict], ray_texts: list[str]):
        self.ingress_registry = ingress_registry
        self.replicas = replicas
        self.ray_texts = ray_texts

    def collect(self):
        replicas = per_replica_families(self.replicas)
        shown_per_replica = ENGINE_FAMILIES | {f.name for f in replicas}
        for family in self.ingress_registry.collect():
            if family.name not in shown_per_replica:
                yield family
        yield from replicas
        yield from affinity_families(self.replicas)
        yield from merge_exposition(self.ray_texts)


async def ray_node_metrics() -> list[str]:
    """The Prometheus pages of every live node's Ray metrics agent (unreachable ones are
    left out, with a warning)."""
    import httpx
    import ray

    nodes = await asyncio.to_thread(ray.nodes)
    urls = [
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in nodes
        if n.get("Alive") and n.get("MetricsExportPort")
    ]
    async with httpx.AsyncClient(timeout=RAY_SCRAPE_TIMEOUT_S) as client:
        replies = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    texts = []
    for url, reply in zip(urls, replies, strict=True):
        if isinstance(reply, BaseException) or reply.status_code != 200:
            logger.warning("Ray metrics at %s not read: %s", url, reply)
        else:
            texts.append(reply.text)
    return texts


def cluster_page(client, ray_metrics=ray_node_metrics):
    """The Ray ingress's /metrics page (create_app's metrics_page): the ingress's own figures,
    every replica's engine figures, the cluster's adapter affinity and Ray's node metrics
    (best effort: without them when unreachable)."""

    async def page(metrics: ServerMetrics) -> bytes:
        try:
            texts = await ray_metrics()
        except Exception as exc:  # Ray's part is best effort; ort-lora's is always shown
            logger.warning("Ray metrics not read: %s", exc)
            texts = []
        view = ClusterPage(metrics.registry, client.replicas, texts)
        return await asyncio.to_thread(generate_latest, view)

    return page
