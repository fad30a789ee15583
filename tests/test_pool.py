"""PagePool: KV allocation, adapter pinning, LRU eviction, unified paging, stats."""

import random

import pytest

from ort_lora.engine.pool import PagePool, PoolExhausted


def test_allocate_and_free_kv():
    pool = PagePool(10)
    a, b = pool.allocate_kv(3), pool.allocate_kv(4)
    assert len(set(a) | set(b)) == 7 and all(0 <= p < 10 for p in a + b)
    assert pool.stats().kv_pages == 7 and pool.stats().free_pages == 3
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    pool.free_kv(a)
    assert pool.stats().free_pages == 6 and pool.stats().kv_pages == 4
    with pytest.raises(ValueError, match="not allocated KV pages"):
        pool.free_kv(a)  # double free
    with pytest.raises(ValueError, match="not allocated KV pages"):
        pool.free_kv([b[0], b[0]])


def test_scatter_free_reorders_the_free_pages_only():
    pool = PagePool(64)
    held = pool.allocate_kv(4)
    before = pool.free_pages()
    pool.scatter_free(seed=3)
    after = pool.free_pages()
    assert sorted(after) == sorted(before) and after != before
    assert pool.stats().kv_pages == 4 and pool.stats().free_pages == 60
    assert pool.allocate_kv(3) == after[:3]  # handed out in the new order
    assert set(held).isdisjoint(pool.free_pages())
    again = PagePool(64)  # the same seed, the same order
    again.allocate_kv(4)
    again.scatter_free(seed=3)
    assert again.free_pages() == after


def test_exhausted_allocation_changes_nothing():
    pool = PagePool(8)
    pool.acquire_adapter("a", 2)
    pool.release_adapter("a")  # idle: 2 evictable pages
    pool.allocate_kv(5)
    before = pool.stats()
    with pytest.raises(PoolExhausted, match="cannot allocate 4 pages: 1 free and 2 in idle"):
        pool.allocate_kv(4)
    assert pool.stats() == before and pool.is_resident("a")
    with pytest.raises(PoolExhausted):
        pool.acquire_adapter("b", 4)
    assert pool.stats() == before and not pool.is_resident("b")


def test_acquire_hit_miss_and_release():
    pool = PagePool(12)
    pages, needs_load = pool.acquire_adapter(7, 3)
    assert needs_load and len(pages) == 3
    again, needs_load = pool.acquire_adapter(7, 3)
    assert again == pages and not needs_load and pool.refcount(7) == 2
    pool.release_adapter(7)
    pool.release_adapter(7)
    assert pool.refcount(7) == 0 and pool.is_resident(7) and pool.adapter_pages(7) == pages
    with pytest.raises(ValueError, match="adapter 7 is not pinned"):
        pool.release_adapter(7)
    with pytest.raises(ValueError, match="resident with 3 pages, asked for 4"):
        pool.acquire_adapter(7, 4)
    s = pool.stats()
    assert (s.adapter_loads, s.adapter_misses, s.adapter_hits) == (1, 1, 1)
    assert (s.adapter_pages_idle, s.adapter_pages_pinned, s.resident_adapters) == (3, 0, 1)


def test_lru_eviction_order():
    pool = PagePool(9)
    for name in ("a", "b", "c"):
        pool.acquire_adapter(name, 3)
        pool.release_adapter(name)
    pool.acquire_adapter("a", 3)  # a hit makes "a" most recently used: LRU order b, c, a
    pool.release_adapter("a")
    b_pages = pool.adapter_pages("b")
    kv = pool.allocate_kv(2)
    assert not pool.is_resident("b") and pool.is_resident("c") and pool.is_resident("a")
    assert set(kv) <= set(b_pages)
    pool.allocate_kv(2)  # one page of b left free, then c goes
    assert not pool.is_resident("c") and pool.is_resident("a")
    assert pool.stats().adapter_evictions == 2


def test_pinned_adapter_never_evicted():
    pool = PagePool(10)
    pinned, _ = pool.acquire_adapter("hot", 4)
    pool.acquire_adapter("cold", 3)
    pool.release_adapter("cold")
    assert pool.can_allocate(6) and not pool.can_allocate(7)
    with pytest.raises(PoolExhausted):
        pool.allocate_kv(7)
    kv = pool.allocate_kv(6)
    assert pool.is_resident("hot") and not pool.is_resident("cold")
    assert not set(kv) & set(pinned)
    assert pool.stats().adapter_pages_pinned == 4 and pool.stats().free_pages == 0


def test_can_admit_counts_adapter_and_kv_together():
    pool = PagePool(10)
    pool.acquire_adapter("x", 4)
    pool.release_adapter("x")  # idle resident, 6 free
    # A request for x: x costs nothing but must not be counted as evictable for its own KV.
    assert pool.can_admit(6, "x", 4) and not pool.can_admit(7, "x", 4)
    # A request for y: y's 3 pages + KV may use free pages and evict x.
    assert pool.can_admit(7, "y", 3) and not pool.can_admit(8, "y", 3)
    assert pool.can_admit(10, None, 0) and not pool.can_admit(11, None, 0)


def test_drop_adapter():
    pool = PagePool(6)
    pool.acquire_adapter("a", 2)
    assert not pool.drop_adapter("a")  # pinned
    pool.release_adapter("a")
    assert pool.drop_adapter("a") and not pool.is_resident("a")
    assert pool.stats().free_pages == 6 and not pool.drop_adapter("a")
    with pytest.raises(KeyError, match="adapter 'a' is not resident"):
        pool.adapter_pages("a")


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="num_pages must be a positive integer"):
        PagePool(0)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PagePool(4).acquire_adapter("a", 0)


def claim(pool: PagePool, owners: dict[int, str], pages: list[int], who: str) -> None:
    """Record new owners; a page may only come from nobody or from an evicted adapter."""
    for p in pages:
        prev = owners.get(p)
        assert prev != "kv", f"page {p} handed out while a KV block"
        if prev is not None and prev != who:
            assert not pool.is_resident(prev), f"page {p} taken from resident adapter {prev}"
        owners[p] = who


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_unified_memory_flows_both_ways(seed):
    """Idle adapters give pages to a burst of long requests; finished requests give them back."""
    rng = random.Random(seed)
    num_pages = 64
    pool = PagePool(num_pages)
    owners: dict[int, object] = {}
    adapters = [f"lora{i}" for i in range(12)]
    sizes = {a: rng.randint(2, 5) for a in adapters}
    for a in adapters[:8]:  # phase 1: many adapters used once, then idle
        pages, needs_load = pool.acquire_adapter(a, sizes[a])
        assert needs_load and not set(pages) & set(owners)
        owners.update(dict.fromkeys(pages, a))
        pool.release_adapter(a)
    idle_before = pool.stats().adapter_pages_idle
    assert idle_before == sum(sizes[a] for a in adapters[:8])
    burst = []  # phase 2: long KV requests until the pool is full of KV
    while pool.can_allocate(6):
        pages = pool.allocate_kv(6)
        claim(pool, owners, pages, "kv")
        burst.append(pages)
    s = pool.stats()
    assert s.adapter_evictions > 0 and s.kv_pages == 6 * len(burst)
    assert s.kv_pages > num_pages - idle_before  # KV took pages adapters held
    for pages in burst:  # phase 3: requests finish, distinct adapters take the pages back
        pool.free_kv(pages)
        for p in pages:
            del owners[p]
    for a in adapters:
        pages, _ = pool.acquire_adapter(a, sizes[a])
        claim(pool, owners, pages, a)
    s = pool.stats()
    assert s.resident_adapters == len(adapters) and s.kv_pages == 0
    assert s.adapter_pages_pinned == sum(sizes.values())
    for a in adapters:  # all done: nothing pinned; unloading frees every page
        pool.release_adapter(a)
        assert pool.drop_adapter(a)
    assert pool.stats().free_pages == num_pages


def test_prefetch_takes_free_pages_only():
    pool = PagePool(8)
    pool.acquire_adapter("a", 2)
    pool.release_adapter("a")  # idle: evictable, but a prefetch never evicts it
    kv = pool.allocate_kv(3)
    assert pool.prefetch_adapter("b", 4) is None  # 3 free pages: nothing changes
    assert pool.num_free == 3 and not pool.is_resident("b")
    pages = pool.prefetch_adapter("b", 3)
    assert sorted(pages) == sorted(set(range(8)) - set(kv) - set(pool.adapter_pages("a")))
    assert pool.refcount("b") == 0 and pool.prefetch_adapter("b", 3) is None  # resident
    s = pool.stats()
    assert (s.adapter_loads, s.adapter_misses, s.adapter_pages_idle) == (2, 1, 5)
    assert pool.acquire_adapter("b", 3) == (pages, False)  # a hit: the weights are in
    pool.release_adapter("b")
    pool.allocate_kv(3)  # "a" is least recently used: evicted, then 1 page of "b"'s
    assert not pool.is_resident("a") and not pool.is_resident("b")
    assert pool.stats().adapter_evictions == 2
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        pool.prefetch_adapter("d", 0)


# ---- prefix cache ---------------------------------------------------------------------------


def _cached(pool: PagePool, n: int, tag=()) -> list[int]:
    """n KV pages registered under hashes h0..h{n-1}, then released: idle cached blocks."""
    pages = pool.allocate_kv(n)
    for i, p in enumerate(pages):
        assert pool.cache_block(p, f"h{i}".encode(), tag)
    pool.free_kv(pages)
    return pages


def test_cached_blocks_are_shared_counted_and_kept_idle():
    pool = PagePool(8)
    pages = _cached(pool, 3)
    assert pool.stats().cached_pages == 3 and pool.stats().free_pages == 5
    assert pool.lookup([b"h0", b"h1", b"x", b"h2"]) == pages[:2]  # the longest prefix only
    pool.share_kv(pages[:2])
    pool.share_kv(pages[:1])
    assert pool.kv_refcounts() == {pages[0]: 2, pages[1]: 1}
    assert pool.cached_pages() == [pages[2]]
    private = pool.allocate_kv(1)
    assert not pool.cache_block(private[0], b"h0")  # that hash is cached in another page
    pool.free_kv([pages[0], pages[1], private[0]])
    assert pool.kv_refcounts() == {pages[0]: 1} and private[0] in pool.free_pages()
    with pytest.raises(ValueError, match="not cached KV blocks"):
        pool.share_kv(private)
    with pytest.raises(ValueError, match="not an allocated KV page"):
        pool.cache_block(private[0], b"new")


def test_idle_blocks_and_idle_adapters_share_one_lru():
    pool = PagePool(6)
    pool.acquire_adapter("old", 2)
    pool.release_adapter("old")  # idle first
    blocks = _cached(pool, 2)  # idle after it; freed last block first (a prefix outlives it)
    pool.acquire_adapter("new", 2)
    pool.release_adapter("new")
    assert pool.can_allocate(6) and pool.stats().free_pages == 0
    pool.allocate_kv(2)  # the adapter idle longest goes first
    assert not pool.is_resident("old") and pool.stats().cached_pages == 2
    pool.allocate_kv(1)  # then the tail block, then the head
    assert pool.lookup([b"h0", b"h1"]) == blocks[:1]
    pool.allocate_kv(1)
    assert pool.lookup([b"h0"]) == [] and pool.is_resident("new")
    assert pool.block_hashes() == {}


def test_admission_counts_shared_blocks_as_held():
    pool = PagePool(4)
    pages = _cached(pool, 2)
    pool.allocate_kv(2)  # no free page left: only the two idle blocks are obtainable
    assert pool.can_admit_all(2, [])  # two new pages: evicting both blocks
    assert not pool.can_admit_all(1, [], shared=pages[:2])  # sharing them leaves none
    assert pool.can_admit_all(1, [], shared=pages[:1])


def test_prefetch_takes_idle_blocks_but_no_adapter():
    pool = PagePool(5)
    pool.acquire_adapter("a", 2)
    pool.release_adapter("a")
    _cached(pool, 3)
    assert pool.prefetch_adapter("b", 4) is None  # would need adapter a's pages
    assert len(pool.prefetch_adapter("b", 3)) == 3
    assert pool.is_resident("a") and pool.stats().cached_pages == 0


def test_dropping_an_adapter_uncaches_its_blocks():
    pool = PagePool(8)
    mine = _cached(pool, 2, tag=(7,))
    held = pool.allocate_kv(1)
    pool.cache_block(held[0], b"held", (7, 9))
    other = pool.allocate_kv(1)
    pool.cache_block(other[0], b"base", ())
    pool.free_kv(other)
    assert not pool.drop_adapter(7)  # not resident: its blocks go all the same
    assert pool.lookup([b"h0"]) == [] and pool.lookup([b"held"]) == []
    assert set(mine) <= set(pool.free_pages()) and pool.cached_pages() == other
    pool.free_kv(held)  # referenced while uncached: freed when let go
    assert held[0] in pool.free_pages()
