"""What /metrics shows of an engine: requests, pool pages by use, per-adapter residency and
counters, prefix-cache lookups (in prompt tokens, total and per adapter), the last step's
times. Read between steps (AsyncEngine keeps a snapshot)."""

from __future__ import annotations

from ort_lora.adapters.registry import AdapterRegistry
from ort_lora.engine.pool import PagePool
from ort_lora.engine.scheduler import Scheduler
from ort_lora.timing import StepTimes

COUNTERS = ("loads", "evictions", "hits", "misses")


def engine_stats(
    scheduler: Scheduler, pool: PagePool, registry: AdapterRegistry, times: StepTimes
) -> dict:
    sched, pages = scheduler.stats(), pool.stats()
    cached = set(registry.cached_ids())
    adapters = {}
    for r in registry.requests():
        aid = r.lora_int_id
        where = "device" if pool.is_resident(aid) else "host" if aid in cached else "none"
        counters = pool.adapter_counters.get(aid, {})
        queried, found = scheduler.prefix_counts.get(aid, (0, 0))
        adapters[r.lora_name] = {
            "resident": where,
            **{k: counters.get(k, 0) for k in COUNTERS},
            "requests": registry.request_counts.get(aid, 0),  # alone or composed
            "prefix_queries": queried,
            "prefix_hits": found,
        }
    return {
        "running": sched.num_running,
        "waiting": sched.num_waiting,
        "preemptions": sched.num_preemptions,
        "pool": {
            "kv": pages.kv_pages,
            "free": pages.free_pages,
            "adapter": pages.adapter_pages_pinned + pages.adapter_pages_idle,
            "cached": pages.cached_pages,
        },
        "prefix_cache": {"queries": sched.prefix_queries, "hits": sched.prefix_hits},
        "adapters": adapters,
        "step": times,
    }
