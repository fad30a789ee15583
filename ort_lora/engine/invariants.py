"""assert_invariants: what holds between any two engine steps, checked from the outside.

Engine tests call it after every step (tests/conftest.py wraps LLMEngine.step), as
onnxruntime-genai's engine tests do: a bookkeeping slip fails at the step that made it, not
steps later as a wrong token or a leaked page.
"""

from __future__ import annotations

from collections import Counter

from ort_lora.adapters.registry import AdapterRegistry
from ort_lora.engine.pool import PagePool
from ort_lora.engine.scheduler import Scheduler
from ort_lora.engine.sequence import SequenceStatus


def assert_invariants(
    pool: PagePool, registry: AdapterRegistry | None, scheduler: Scheduler, tracker=None
) -> None:
    """AssertionError naming the first broken invariant. registry: None for a scheduler
    driven alone (its adapter ids are not registered anywhere); tracker: the engine's
    RequestTracker, whose unfinished sequences must be the scheduler's."""
    _pages_add_up(pool)
    _blocks_owned_once(pool, scheduler)
    _adapters_pinned_by_running(pool, scheduler)
    if registry is not None:
        _adapters_registered_with_users(pool, registry, scheduler)
    if tracker is not None:
        ours = {s.completion_id for s in tracker.unfinished()}
        assert ours == set(scheduler.sequences), (
            f"tracker has {sorted(ours)}, scheduler has {sorted(scheduler.sequences)}"
        )


def _pages_add_up(pool: PagePool) -> None:
    """Free, KV and adapter pages partition the pool: every page has exactly one use."""
    adapter = [p for pages, _ in pool.residents().values() for p in pages]
    used = Counter([*pool.free_pages(), *pool.kv_pages(), *adapter])
    twice = sorted(p for p, n in used.items() if n > 1)
    assert not twice, f"pages {twice} have more than one use"
    assert set(used) == set(range(pool.num_pages)), (
        f"pages by use cover {len(used)} of {pool.num_pages} pages"
    )


def _blocks_owned_once(pool: PagePool, scheduler: Scheduler) -> None:
    """Running sequences own the KV pages, each page one block of one sequence, enough
    blocks for their computed tokens; waiting ones hold none."""
    blocks = [p for s in scheduler.running for p in s.block_table]
    assert len(blocks) == len(set(blocks)), "a KV page is in two block tables"
    assert set(blocks) == pool.kv_pages(), "KV pages and running block tables differ"
    bs = scheduler.config.block_size
    for s in scheduler.running:
        assert s.status is SequenceStatus.RUNNING, f"{s} is in the running list"
        assert len(s.block_table) * bs >= s.num_computed_tokens, f"{s} lacks blocks"
    for s in scheduler.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table, f"{s} is waiting"
    queued = [s.completion_id for s in [*scheduler.running, *scheduler.waiting]]
    assert sorted(queued) == sorted(scheduler.sequences), "running + waiting != sequences"


def _adapters_pinned_by_running(pool: PagePool, scheduler: Scheduler) -> None:
    """Every adapter a running sequence runs with (its one, or each composed) is resident and
    pinned once per such sequence; nothing is pinned without one."""
    pins = Counter(aid for s in scheduler.running for aid in s.adapter_ids)
    held = {a: refs for a, (_, refs) in pool.residents().items() if refs}
    assert held == dict(pins), f"adapter pins {held} != running sequences per adapter {pins}"


def _adapters_registered_with_users(pool: PagePool, registry: AdapterRegistry, scheduler):
    """Resident adapters are registered, at their registered size, and the registry counts
    each unfinished sequence as a user of each adapter it runs with."""
    for a, (pages, _) in pool.residents().items():
        assert a in registry, f"resident adapter {a!r} is not registered"
        assert len(pages) == registry.num_pages_needed(a), f"adapter {a!r} has a stale size"
    users = Counter(aid for s in scheduler.sequences.values() for aid in s.adapter_ids)
    assert registry.user_counts() == dict(users), (
        f"registry users {registry.user_counts()} != unfinished sequences {dict(users)}"
    )
