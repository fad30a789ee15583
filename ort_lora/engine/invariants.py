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
    _cache_consistent(pool, scheduler)
    _adapters_pinned_by_running(pool, scheduler)
    if registry is not None:
        _adapters_registered_with_users(pool, registry, scheduler)
    if tracker is not None:
        ours = {s.completion_id for s in tracker.unfinished()}
        assert ours == set(scheduler.sequences), (
            f"tracker has {sorted(ours)}, scheduler has {sorted(scheduler.sequences)}"
        )


def _pages_add_up(pool: PagePool) -> None:
    """Free, KV, idle cached and adapter pages partition the pool: every page has exactly
    one use."""
    adapter = [p for pages, _ in pool.residents().values() for p in pages]
    used = Counter([*pool.free_pages(), *pool.kv_pages(), *pool.cached_pages(), *adapter])
    twice = sorted(p for p, n in used.items() if n > 1)
    assert not twice, f"pages {twice} have more than one use"
    assert set(used) == set(range(pool.num_pages)), (
        f"pages by use cover {len(used)} of {pool.num_pages} pages"
    )


def _blocks_owned_once(pool: PagePool, scheduler: Scheduler) -> None:
    """Running sequences hold the KV pages, each page's reference count the number of block
    tables listing it, enough blocks for their computed tokens; a page in two tables is a
    cached block, full and computed in each (nobody writes into a block another reads);
    waiting ones hold none."""
    blocks = Counter(p for s in scheduler.running for p in s.block_table)
    assert dict(blocks) == pool.kv_refcounts(), "KV page references != running block tables"
    hashed, bs = pool.block_hashes(), scheduler.config.block_size
    for s in scheduler.running:
        assert s.status is SequenceStatus.RUNNING, f"{s} is in the running list"
        assert len(s.block_table) * bs >= s.num_computed_tokens, f"{s} lacks blocks"
        assert len(set(s.block_table)) == len(s.block_table), f"{s} lists a page twice"
        for i, p in enumerate(s.block_table):
            if blocks[p] > 1:
                assert p in hashed, f"page {p} is in {blocks[p]} tables but not cached"
                assert (i + 1) * bs <= s.num_computed_tokens, f"{s} shares unfinished block {i}"
    for s in scheduler.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table, f"{s} is waiting"
    queued = [s.completion_id for s in [*scheduler.running, *scheduler.waiting]]
    assert sorted(queued) == sorted(scheduler.sequences), "running + waiting != sequences"


def _cache_consistent(pool: PagePool, scheduler: Scheduler) -> None:
    """Cached pages and hashes map one to one; an idle cached page is hashed and in no block
    table; a running sequence's registered blocks carry the hashes of its own tokens."""
    hashed = pool.block_hashes()
    assert len(set(hashed.values())) == len(hashed), "two cached pages have one hash"
    assert all(pool.hashed_page(h) == p for p, h in hashed.items()), "hash -> page is stale"
    idle = pool.cached_pages()
    assert set(idle) <= set(hashed), "an idle cached page has no hash"
    assert not set(idle) & pool.kv_pages(), "an idle cached page is in a block table"
    for s in scheduler.running:
        assert s.num_cached_blocks <= len(s.block_hashes), f"{s} lacks hashes"
        for i in range(s.num_cached_blocks):
            page = s.block_table[i]
            if page in hashed:  # (a block computed twice at once stays private)
                assert hashed[page] == s.block_hashes[i], f"{s} block {i} has another hash"


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
