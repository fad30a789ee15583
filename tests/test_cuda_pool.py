"""Host side of the CUDA pool (ort_lora/runtime/cuda_pool.py), on CPU: bind plan, upload copies,
bfloat16 rounding, the prefetch bookkeeping, and CudaPool itself over host memory. The oracles
are independent: the CPU pool that registry.write_to_pool fills directly, a byte-level memcpy2D
simulation, and torch's bfloat16.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_lora.adapters.host import HostAdapter, ModuleWeights
from ort_lora.adapters.layout import packing, write_to_pool
from ort_lora.bfloat16 import float32_to_bfloat16_bits
from ort_lora.contract import ModelManifest, key_cache_name, value_cache_name
from ort_lora.runtime.cuda_layout import page_runs, pool_bind_plan, pool_bytes, upload_copies
from ort_lora.runtime.cuda_pool import CudaError, CudaPool
from ort_lora.runtime.prefetch import Load, PrefetchTracker, Staging


def manifest(dtype="float16", layers=3, block=4, kv_heads=2, head_dim=8) -> ModelManifest:
    return ModelManifest(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=layers, hidden_size=32,
        num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=48,
        vocab_size=64, max_position_embeddings=128, block_size=block, dtype=dtype,
        device="cuda", lora_targets={"q_proj": {"in": 32, "out": 32}, "down_proj":
        {"in": 48, "out": 32}}, eos_token_ids=[0],
    )  # fmt: skip


def random_adapter(rng, m: ModelManifest, rank=3) -> HostAdapter:
    modules = {}
    for name, size in m.lora_targets.items():
        modules[name] = ModuleWeights(
            a=rng.standard_normal((m.num_layers, rank, size["in"])).astype(np.float32),
            bt=rng.standard_normal((m.num_layers, rank, size["out"])).astype(np.float32),
            ranks=np.full(m.num_layers, rank, np.int32),
            scales=np.full(m.num_layers, 0.5, np.float32),
        )
    return HostAdapter("a", Path("."), modules)


def simulate_copies(pool_bytes_: bytearray, staging: bytes, copies) -> None:
    """cudaMemcpy2D, byte by byte, the way CUDA defines it."""
    for c in copies:
        for row in range(c.height):
            d = c.dst_offset + row * c.dst_pitch
            s = c.src_offset + row * c.src_pitch
            pool_bytes_[d : d + c.width] = staging[s : s + c.width]


def test_bind_plan_matches_the_cpu_pool_views():
    m, num_pages, base = manifest(), 5, 1 << 20
    plan = pool_bind_plan(m, num_pages, base)
    pool = np.zeros((m.num_layers, 2, num_pages, m.block_size, m.num_kv_heads, m.head_dim),
                    np.float16)  # fmt: skip
    assert pool_bytes(m, num_pages) == pool.nbytes
    views = {}
    for layer in range(m.num_layers):
        views[key_cache_name(layer)] = pool[layer, 0]
        views[value_cache_name(layer)] = pool[layer, 1]
    assert [b.name for b in plan] == list(views)
    for b in plan:
        view = views[b.name]
        assert b.shape == view.shape
        assert b.ptr - base == view.__array_interface__["data"][0] - pool.ctypes.data


@pytest.mark.parametrize("pages", [[3, 4, 5], [6, 1, 2], [0], [7, 5, 3, 4]])
def test_upload_copies_land_rows_where_write_to_pool_puts_them(pages):
    rng = np.random.default_rng(len(pages) * 7 + pages[0])
    m, num_pages = manifest(block=4), 12
    adapter = random_adapter(rng, m)
    need = packing(adapter, m.page_elems).num_pages
    pages = pages + [p for p in range(num_pages) if p not in pages][: max(0, need - len(pages))]
    shape = (m.num_layers, 2, num_pages, m.block_size, m.num_kv_heads, m.head_dim)
    expected = rng.standard_normal(shape).astype(np.float16)  # KV already in the pool
    device = bytearray(expected.tobytes())
    expected[:, :, pages] = 0  # the adapter owns its pages whole: rows, and zeros between them
    write_to_pool(adapter, pages, expected)
    staging = np.zeros((m.num_layers, 2, len(pages), *shape[3:]), np.float16)
    write_to_pool(adapter, list(range(len(pages))), staging)
    copies = upload_copies(m, num_pages, pages)
    assert len(copies) == 2 * len(page_runs(pages))
    simulate_copies(device, staging.tobytes(), copies)
    got = np.frombuffer(bytes(device), np.float16).reshape(shape)
    np.testing.assert_array_equal(got, expected)


def test_page_runs():
    assert page_runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
    assert page_runs([]) == []


def test_bfloat16_bits_match_torch():
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * 100
    x[:3] = [np.inf, -np.inf, 0.0]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float32_to_bfloat16_bits(x), want)


def test_cpu_pool_dtype_is_refused():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        pool_bind_plan(manifest(dtype="float32"), 4, 0)


def test_tracker_waits_for_all_but_the_step_prefetches_and_reuses_staging():
    """A step waits for every copy in flight except the prefetches issued for it (their pages
    were free when it was scheduled); the next step waits for those too."""
    t = PrefetchTracker()
    assert t.acquire(10) is None
    s1, s2, s3 = Staging(100, 64), Staging(200, 256), Staging(300, 8)
    t.begin(Load(1, (0, 1), "e1", s1))  # used by step 0
    t.begin(Load(2, (2,), "e2", s2, prefetch=True))  # for a waiting request
    assert t.events_for_step() == ["e1"] and t.step == 1
    t.begin(Load(3, (5,), "e3", s3, prefetch=True))
    assert t.events_for_step() == ["e1", "e2"]  # e2 is an earlier step's prefetch now
    assert t.events_for_step() == ["e1", "e2", "e3"]
    assert t.acquire(1) is None  # every buffer is still being copied from
    done = t.retire(lambda e: e == "e2")
    assert [ld.adapter_id for ld in done] == [2]
    assert t.is_loading(1) and not t.is_loading(2)
    assert t.acquire(300) is None
    assert t.acquire(100) is s2 and t.acquire(1) is None
    t.retire(lambda e: True)
    assert t.inflight == [] and t.acquire(64) is s1


class HostMemoryRuntime:
    """CudaRuntime's interface over host memory: "device" and pinned allocations are numpy
    buffers, copies are real memmoves done when enqueued, and events fire when the test says.
    It records every call so the test can check ordering (which stream, which event)."""

    def __init__(self):
        self.buffers, self.calls, self.fired, self.host_allocs = [], [], set(), []
        self._handles = iter(range(1000, 10**6))

    def device_count(self) -> int:
        return 1

    def _alloc(self, nbytes: int) -> int:
        buf = np.full(nbytes, 0xAB, np.uint8)  # garbage, as fresh memory is
        self.buffers.append(buf)
        return buf.ctypes.data

    def malloc(self, nbytes: int) -> int:
        self.calls.append(("malloc", nbytes))
        return self._alloc(nbytes)

    def host_alloc(self, nbytes: int) -> int:
        self.calls.append(("host_alloc", nbytes))
        self.host_allocs.append(self._alloc(nbytes))
        return self.host_allocs[-1]

    def stream(self) -> int:
        handle = next(self._handles)
        self.calls.append(("stream_create", handle))
        return handle

    def event(self) -> int:
        handle = next(self._handles)
        self.calls.append(("event_create", handle))
        return handle

    def event_done(self, event: int) -> bool:
        return event in self.fired

    def call(self, name: str, *args) -> int:
        values = [getattr(a, "value", a) for a in args]
        self.calls.append((name, *values))
        if name == "memset":
            ctypes.memset(values[0], values[1], values[2])
        return 0

    def copy_2d(self, dst: int, c, src: int, stream: int) -> None:
        self.calls.append(("copy_2d", stream))
        for row in range(c.height):
            ctypes.memmove(
                dst + c.dst_offset + row * c.dst_pitch,
                src + c.src_offset + row * c.src_pitch,
                c.width,
            )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_pool_uploads_adapters_and_orders_streams(dtype):
    """CudaPool over host memory: an adapter load lands exactly the rows write_to_pool puts in
    a CPU pool (bfloat16 as torch rounds it), on the copy stream, behind the pool's zeroing;
    a step waits on the compute stream for every upload but its own prefetches; staging
    memory is reused only after its copy's event fired."""
    rng = np.random.default_rng(11)
    m, num_pages = manifest(dtype=dtype, block=4), 24
    rt = HostMemoryRuntime()
    pool = CudaPool(m, num_pages, rt)
    names = [c[0] for c in rt.calls]
    assert names[:3] == ["malloc", "memset", "stream_synchronize"]  # zeroed before any copy
    assert names[3:] == ["stream_create", "stream_create"]
    adapters = {7: random_adapter(rng, m), 9: random_adapter(rng, m, rank=2)}
    need = {aid: packing(a, m.page_elems).num_pages for aid, a in adapters.items()}
    placed = {7: [4, 5, 1, 12, 13, 14][: need[7]], 9: [20, 8, 9, 10, 11][: need[9]]}
    assert len(placed[7]) == need[7] and len(placed[9]) == need[9]
    for aid, pages in placed.items():
        pool.load(aid, pages, lambda staging, a=adapters[aid]: write_to_pool(
            a, list(range(staging.shape[2])), staging), prefetch=aid == 7)  # fmt: skip
    assert {c[1] for c in rt.calls if c[0] == "copy_2d"} == {pool.copy_stream}
    shape = (m.num_layers, 2, num_pages, m.block_size, m.num_kv_heads, m.head_dim)
    expected, rows = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for aid, pages in placed.items():
        write_to_pool(adapters[aid], pages, expected)
        write_to_pool(_ones_like(adapters[aid]), pages, rows)
    rows = rows != 0  # where adapter rows live (gaps between rows are left undefined)
    device = rt.buffers[0][: pool_bytes(m, num_pages)].view(np.uint16).reshape(shape)
    if dtype == "float16":
        want = expected.astype(np.float16).view(np.uint16)
    else:
        want = torch.from_numpy(expected).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(device[rows], want.view(np.uint16)[rows])
    others = np.ones(num_pages, bool)
    others[sum(placed.values(), [])] = False
    assert not device[:, :, others].any()  # pages no adapter owns stay zero

    events = {ld.adapter_id: ld.event for ld in pool.tracker.inflight}
    rt.calls.clear()
    pool.wait_for_step()  # 7 is a prefetch issued for this step: not waited for
    assert rt.calls == [("stream_wait_event", pool.compute_stream, events[9])]
    staging_7 = next(ld.staging for ld in pool.tracker.inflight if ld.adapter_id == 7)
    pool.load(7, [2, 3, 6, 7], lambda s: None)  # adapter 7's copy is still in flight
    assert pool.tracker.inflight[-1].staging is not staging_7
    rt.fired.add(events[7])
    pool.poll()
    assert ("event_destroy", events[7]) in rt.calls
    pool.load(3, [0, 15, 16, 17], lambda s: None)
    assert pool.tracker.inflight[-1].staging is staging_7  # reused once its copy landed


def _ones_like(adapter: HostAdapter) -> HostAdapter:
    modules = {
        name: ModuleWeights(np.ones_like(w.a), np.ones_like(w.bt), w.ranks, w.scales)
        for name, w in adapter.modules.items()
    }
    return HostAdapter(adapter.name, adapter.path, modules)


def test_close_frees_every_allocation_stream_and_event_once():
    """CudaPool.close waits for both streams, then destroys the events of uploads in flight,
    frees every pinned staging buffer (in flight or idle), releases what the LoraSGMV op keeps
    for the compute stream before that stream is destroyed, destroys both streams and frees the
    pool. Twice is a no-op; a closed pool refuses loads and steps, naming why."""
    rng = np.random.default_rng(12)
    m, rt = manifest(block=4), HostMemoryRuntime()
    pool = CudaPool(m, 24, rt)
    adapter = random_adapter(rng, m)
    fill = functools.partial(_fill, adapter)
    need = packing(adapter, m.page_elems).num_pages
    pool.load(1, list(range(need)), fill)
    rt.fired.add(pool.tracker.inflight[0].event)
    pool.poll()  # its staging is idle now
    pool.load(2, list(range(need, 2 * need)), fill)
    pool.load(3, list(range(2 * need, 3 * need)), fill)  # staging: one reused, one new
    live_events = [ld.event for ld in pool.tracker.inflight]
    assert len(live_events) == 2 and len(pool.tracker.free) == 0
    rt.calls.clear()
    pool.close()
    streams = [pool.copy_stream, pool.compute_stream]
    freed = [c[1] for c in rt.calls if c[0] == "host_free"]
    assert len(rt.host_allocs) == 2 and sorted(freed) == sorted(rt.host_allocs)
    assert sorted(c[1] for c in rt.calls if c[0] == "event_destroy") == sorted(live_events)
    assert [c[1] for c in rt.calls if c[0] == "free"] == [pool.base]
    assert sorted(c[1] for c in rt.calls if c[0] == "stream_destroy") == sorted(streams)
    order = [c[:2] for c in rt.calls]
    assert order[:2] == [("stream_synchronize", s) for s in streams]
    release = order.index(("sgmv_release_stream", pool.compute_stream))
    assert release < order.index(("stream_destroy", pool.compute_stream))
    rt.calls.clear()
    pool.close()
    assert rt.calls == []
    with pytest.raises(CudaError, match="cannot load an adapter: this CudaPool is closed"):
        pool.load(4, [0], fill)
    with pytest.raises(CudaError, match="cannot run a step: this CudaPool is closed"):
        pool.wait_for_step()


def test_a_failed_pool_creation_frees_the_pool():
    class NoStreams(HostMemoryRuntime):
        def stream(self) -> int:
            raise CudaError("ort_lora_cuda_stream_create failed: out of resources (code 2)")

    rt = NoStreams()
    with pytest.raises(CudaError, match="stream_create failed"):
        CudaPool(manifest(), 4, rt)
    base = rt.buffers[0].ctypes.data
    assert ("free", base) in rt.calls


def _fill(adapter, staging) -> None:
    write_to_pool(adapter, list(range(staging.shape[2])), staging)
