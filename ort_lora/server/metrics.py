"""Prometheus metrics, vLLM's names under an `ort_lora:` prefix, plus what is particular to
unified paging: per-adapter residency, loads, evictions, cache hits/misses, prefix-cache
lookups per adapter, and pool pages by use.

Latencies and token counts are observed by the HTTP layer as requests stream; engine state
(queues, preemptions, adapters, pool) is read from `engine.stats()` at scrape time, so the
figures are never stale and the engine thread does no metrics work.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "ort_lora:"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RESIDENCY = ("device", "host", "none")
POOL_USES = ("kv", "adapter", "cached", "free")
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120)


class EngineStatsCollector:
    """Turns `engine.stats()` into gauges and counters at every scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def describe(self):
        return []  # stats() may not be ready at registration: collect lazily

    def collect(self):
        stats = self.stats()
        yield _gauge("num_requests_running", "Requests running in the engine", stats["running"])
        yield _gauge("num_requests_waiting", "Requests waiting to run", stats["waiting"])
        yield CounterMetricFamily(
            PREFIX + "num_preemptions", "Preemptions (requests recomputed)", stats["preemptions"]
        )
        pool = GaugeMetricFamily(PREFIX + "pool_pages", "Pool pages by use", labels=["use"])
        for use in POOL_USES:
            pool.add_metric([use], stats["pool"].get(use, 0))
        yield pool
        yield from _prefix_families(stats.get("prefix_cache", {}))
        yield from _adapter_families(stats.get("adapters", {}))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _prefix_families(prefix: dict):
    queries, hits = prefix.get("queries", 0), prefix.get("hits", 0)
    yield CounterMetricFamily(
        PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries
    )
    yield CounterMetricFamily(
        PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", hits
    )
    yield _gauge(
        "prefix_cache_hit_rate",
        "Share of looked-up prompt tokens found in the prefix cache, since start",
        hits / queries if queries else 0.0,
    )


def _adapter_families(adapters: dict[str, dict]):
    labels = ["lora_name"]
    resident = GaugeMetricFamily(
        PREFIX + "lora_resident",
        "1 where the adapter's weights are (device pool pages, host cache, or none)",
        labels=["lora_name", "location"],
    )
    counters = {
        key: CounterMetricFamily(PREFIX + f"lora_{key}", doc, labels=labels)
        for key, doc in (
            ("loads", "Adapter copies into pool pages"),
            ("evictions", "Adapter evictions from pool pages"),
            ("hits", "Requests that found their adapter resident in the pool"),
            ("misses", "Requests that had to load their adapter"),
            ("requests", "Requests served with the adapter, alone or in a composition"),
            ("prefix_queries", "Prompt tokens of the adapter's requests looked up in the cache"),
            ("prefix_hits", "Prompt tokens of the adapter's requests found in the cache"),
        )
    }
    for name, info in sorted(adapters.items()):
        for where in RESIDENCY:
            resident.add_metric([name, where], 1.0 if info.get("resident") == where else 0.0)
        for key, family in counters.items():
            family.add_metric([name], info.get(key, 0))
    yield resident
    yield from counters.values()


class ServerMetrics:
    """The metrics registry of one server (one per app, so tests can run several)."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(stats))
        reg = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed", ["model_name"], registry=reg
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated", ["model_name"], registry=reg
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one streamed request (feeds TTFT, ITL and e2e histograms)."""

    def __init__(self, metrics: ServerMetrics, model: str, start: float):
        self.metrics, self.model, self.start = metrics, model, start
        self.last: float | None = None
        self.tokens = 0

    def on_tokens(self, now: float, total_tokens: int) -> None:
        """`total_tokens`: output tokens so far over all choices."""
        new = total_tokens - self.tokens
        if new <= 0:
            return
        if self.last is None:
            self.metrics.ttft.labels(self.model).observe(now - self.start)
        else:  # n > 1 or several tokens per step: spread the gap over them
            gap = (now - self.last) / new
            for _ in range(new):
                self.metrics.itl.labels(self.model).observe(gap)
        self.last, self.tokens = now, total_tokens

    def on_finish(self, now: float, prompt_tokens: int, reasons: list[str | None]) -> None:
        m = self.metrics
        m.e2e.labels(self.model).observe(now - self.start)
        m.prompt_tokens.labels(self.model).inc(prompt_tokens)
        m.generation_tokens.labels(self.model).inc(self.tokens)
        for reason in reasons:
            m.request_success.labels(self.model, reason or "abort").inc()
