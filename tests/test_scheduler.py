"""Scheduler + StepPlan: batching rules, adapter cap and fairness, preemption, metadata arrays.

The end-to-end checks drive the scheduler with a fake paged "model" in numpy: it writes
token ids into a flat page cache through slot_mapping, reads each logits row's context back
through block_table, and predicts hash(adapter, context). Each request's output must equal
running it alone (the oracle), however it was batched, chunked, preempted or recomputed.
"""

import random
import zlib

import numpy as np
import pytest

from ort_lora import contract as C
from ort_lora.config import EngineConfig
from ort_lora.engine import (
    MetadataBuffers,
    PagePool,
    Scheduler,
    Sequence,
    SequenceStatus,
    build_metadata,
)
from ort_lora.engine.invariants import assert_invariants
from ort_lora.runtime.prefetch import Load, PrefetchTracker

VOCAB, EOS = 97, 0


def make_scheduler(num_pages=64, **kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("block_size", 4)
    return Scheduler(EngineConfig(num_pages=num_pages, **kw), PagePool(num_pages))


def make_seq(rid, n_prompt, max_tokens=4, adapter=None, pages=2, rng=random, **kw) -> Sequence:
    prompt = [rng.randrange(1, VOCAB) for _ in range(n_prompt)]
    return Sequence(rid, prompt, max_tokens, adapter, pages if adapter else 0, **kw)


def next_token(adapter, context) -> int:
    """The fake model: a deterministic function of the adapter and the whole context."""
    return zlib.crc32(repr((adapter, [int(t) for t in context])).encode()) % VOCAB


def reference_output(seq: Sequence, use_eos: bool) -> list[int]:
    tokens, out = list(seq.prompt_token_ids), []
    while len(out) < seq.max_tokens:
        out.append(next_token(seq.adapter_id, tokens))
        tokens.append(out[-1])
        if use_eos and out[-1] == EOS:
            break
    return out


class FakePagedModel:
    """Token ids stored in pool pages; adapters leave a marker in their pages when loaded.

    Loads are timed as on a GPU (the session's PrefetchTracker, with fake events): a step
    waits for the loads events_for_step names, and the rest stay in flight. No step may read
    or write a page that a copy still in flight lands in.
    """

    def __init__(self, num_pages: int, block_size: int):
        self.bs = block_size
        self.cache = np.full(num_pages * block_size, -1, np.int64)  # [num_pages * block_size]
        self.copies = PrefetchTracker()

    def run(self, plan, meta) -> np.ndarray:
        loads = [(a, False) for a in plan.loads] + [(a, True) for a in plan.prefetch]
        for a, prefetch in loads:
            for p in a.pages:
                self.cache[p * self.bs : (p + 1) * self.bs] = marker(a.adapter_id)
            self.copies.begin(Load(a.adapter_id, a.pages, object(), None, prefetch))
        waited = set(self.copies.events_for_step())
        self.copies.retire(lambda event: event in waited)
        landing = {p for load in self.copies.inflight for p in load.pages}
        kv_pages = set((meta[C.SLOT_MAPPING] // self.bs).tolist())
        assert not kv_pages & landing, "KV written into a page a copy is landing in"
        for a in plan.adapters:  # a resident adapter's pages were never overwritten
            assert not set(a.pages) & landing, f"{a.adapter_id} read while its copy lands"
            for p in a.pages:
                assert (self.cache[p * self.bs : (p + 1) * self.bs] == marker(a.adapter_id)).all()
        self.cache[meta[C.SLOT_MAPPING]] = meta[C.INPUT_IDS]
        cu, pos, table = meta[C.CU_SEQLENS], meta[C.POSITION_IDS], meta[C.BLOCK_TABLE]
        seg_starts, seg_slots = meta[C.LORA_SEG_STARTS], meta[C.LORA_SEG_SLOTS]
        adapter_of_slot = {a.slot: a.adapter_id for a in plan.adapters} | {-1: None}
        preds = []
        for row in meta[C.LOGITS_INDICES]:
            b = np.searchsorted(cu, row, side="right") - 1
            ctx_pos = np.arange(pos[row] + 1)  # [pos + 1]
            ctx = self.cache[table[b, ctx_pos // self.bs] * self.bs + ctx_pos % self.bs]
            slot = seg_slots[np.searchsorted(seg_starts, row, side="right") - 1]
            preds.append(next_token(adapter_of_slot[int(slot)], ctx))
        return np.array(preds)


def marker(adapter_id) -> int:
    return -2 - zlib.crc32(repr(adapter_id).encode()) % 1000


def check_plan(sched: Scheduler, plan) -> None:
    """Invariants every plan must satisfy, from the config and the sequences' own state."""
    cfg = sched.config
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(plan.entries) <= cfg.max_num_seqs
    assert len(plan.adapters) <= cfg.max_loras
    assert [e.slot for e in plan.entries] == sorted(e.slot for e in plan.entries)
    slot_of = {a.adapter_id: a.slot for a in plan.adapters}
    for e in plan.entries:
        seq = sched.get(e.completion_id)
        assert e.slot == slot_of.get(seq.adapter_id, -1)
        assert list(e.token_ids) == seq.token_ids[e.start_pos : e.start_pos + e.num_tokens]
        assert e.start_pos == seq.num_computed_tokens
        assert e.sample == (e.start_pos + e.num_tokens == seq.num_tokens)


def drive(sched: Scheduler, on_step, min_steps: int, use_eos=False, max_steps=500):
    """The engine loop with the fake model; on_step(step, sched) adds requests.

    Returns ({rid: output tokens}, {rid: finished Sequence}, [plans]).
    """
    model = FakePagedModel(sched.pool.num_pages, sched.config.block_size)
    outputs, plans, buffers = {}, [], MetadataBuffers()
    for step in range(max_steps):
        on_step(step, sched)
        if not sched.has_unfinished() and step >= min_steps:
            break
        plan = sched.schedule()
        check_plan(sched, plan)
        plans.append(plan)
        if plan.is_empty:
            continue
        preds = model.run(plan, build_metadata(plan, sched.config.block_size, buffers=buffers))
        sampled = {e.completion_id: int(preds[e.sample_row]) for e in plan.entries if e.sample}
        stop = {r: None for r, t in sampled.items() if t == EOS} if use_eos else {}
        for seq in sched.on_step_done(plan, sampled, stop):
            outputs[seq.completion_id] = seq
        assert_invariants(sched.pool, None, sched)
    assert not sched.has_unfinished(), "requests left after max_steps"
    return {r: s.output_token_ids for r, s in outputs.items()}, outputs, plans


# ---- batching rules ----------------------------------------------------------------------------


def test_decode_first_then_chunked_prefill_under_budget():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a = make_seq("a", 3, max_tokens=10)
    sched.add(a)
    plan = sched.schedule()
    assert [(e.completion_id, e.num_tokens, e.sample) for e in plan.entries] == [("a", 3, True)]
    sched.on_step_done(plan, {"a": 5})
    b = make_seq("b", 20)
    sched.add(b)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        ids = [e.completion_id for e in plan.entries]
        assert ids == ["a", "b"] and plan.entries[0].num_tokens == 1  # decode first
        eb = plan.entries[1]
        chunks.append((eb.start_pos, eb.num_tokens, eb.sample, eb.logit_rows))
        tokens = {"a": 5} | ({"b": 9} if eb.sample else {})
        sched.on_step_done(plan, tokens)
    # 7 + 7 + 6 tokens: only the chunk reaching the prompt end samples (its last row).
    assert chunks == [(0, 7, False, ()), (7, 7, False, ()), (14, 6, True, (5,))]
    assert b.output_token_ids == [9] and len(b.block_table) == 5  # all 20 prompt blocks at once


def test_max_num_seqs_and_admission_order():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(5):
        sched.add(make_seq(f"r{i}", 5, max_tokens=1 if i == 0 else 3))
    plan = sched.schedule()
    assert [e.completion_id for e in plan.entries] == ["r0", "r1", "r2"]
    sched.on_step_done(plan, {e.completion_id: 3 for e in plan.entries})  # r0 done (max_tokens 1)
    plan = sched.schedule()
    assert {e.completion_id for e in plan.entries} == {"r1", "r2", "r3"}
    assert sched.get("r4").status is SequenceStatus.WAITING


def test_max_loras_caps_distinct_adapters_base_never_counts():
    sched = make_scheduler(max_loras=2)
    for rid, adapter in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("x", None), ("a2", "A")]:
        sched.add(make_seq(rid, 4, adapter=adapter))
    plan = sched.schedule()
    assert {e.completion_id for e in plan.entries} == {"a1", "b1", "x", "a2"}
    assert {a.adapter_id for a in plan.adapters} == {"A", "B"}
    assert all(a.needs_load for a in plan.adapters)
    assert [e.slot for e in plan.entries] == [-1, 0, 0, 1]  # base first, then by slot


def test_default_max_loras_is_the_pool_not_a_cap():
    """No max_loras given: every distinct adapter whose pages fit beside the running KV joins
    the step (the old default of 4 serialized 16 adapters); a given max_loras still caps it."""

    def distinct_in_first_step(num_pages: int, **kw) -> int:
        sched = make_scheduler(num_pages, max_num_seqs=32, max_num_batched_tokens=256, **kw)
        rng = random.Random(3)
        for i in range(32):  # 16 adapters x 2 requests: 2 pages each + 2 KV blocks a request
            sched.add(make_seq(f"r{i}", 4, 4, adapter=f"A{i % 16}", rng=rng))
        plan = sched.schedule()
        check_plan(sched, plan)
        return len({a.adapter_id for a in plan.adapters})

    assert distinct_in_first_step(128) == 16  # 16 x 2 adapter pages + 32 x 2 KV blocks fit
    assert distinct_in_first_step(128, max_loras=4) == 4  # an explicit upper bound
    assert 0 < distinct_in_first_step(32) < 16  # a small pool bounds it by itself


def test_rare_adapter_is_not_starved_by_a_flood():
    def run(wait_steps: int, horizon: int = 40) -> int | None:
        sched = make_scheduler(num_pages=256, max_loras=2, max_adapter_wait_steps=wait_steps)
        rng = random.Random(7)
        for step in range(horizon):
            for k in range(3):  # popular adapters P0, P1 keep arriving, always ahead
                sched.add(make_seq(f"p{step}.{k}", 3, 2, adapter=f"P{k % 2}", rng=rng))
            if step == 0:
                sched.add(make_seq("rare", 3, 2, adapter="R", rng=rng))
            plan = sched.schedule()
            if any(e.completion_id == "rare" for e in plan.entries):
                return step
            sched.on_step_done(plan, {e.completion_id: 1 for e in plan.entries if e.sample})
        return None

    # Bound: wait_steps passed over + one request's lifetime (max_tokens 2) for a slot to free.
    assert run(wait_steps=3) is not None and run(wait_steps=3) <= 3 + 2 + 1
    assert run(wait_steps=0) is not None and run(wait_steps=0) <= 2 + 1
    assert run(wait_steps=10**6) is None  # without the rule the flood starves it


def test_preempts_newest_and_recompute_restores_it():
    sched = make_scheduler(num_pages=6, max_num_batched_tokens=16, max_num_seqs=4)
    old, new = make_seq("old", 7, max_tokens=9), make_seq("new", 7, max_tokens=9)
    sched.add(old)
    sched.add(new)
    preempted_at, recompute = None, None
    for step in range(40):
        if step == 1:  # needs 3 blocks while only 2 are free: it waits behind the running ones
            sched.add(make_seq("late", 9, max_tokens=9))
        plan = sched.schedule()
        if plan.preempted:
            assert plan.preempted == ("new",) and preempted_at is None
            assert [e.completion_id for e in plan.entries] == ["old"]
            assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
            assert new.block_table == [] and new.output_token_ids
            assert [s.completion_id for s in sched.waiting] == ["new", "late"]  # front of the queue
            preempted_at, kept = step, list(new.output_token_ids)
        entry = next((e for e in plan.entries if e.completion_id == "new"), None)
        if preempted_at is not None and recompute is None and entry is not None:
            recompute = entry
        sched.on_step_done(plan, {e.completion_id: 4 for e in plan.entries if e.sample})
        if not sched.has_unfinished():
            break
    assert preempted_at is not None and recompute is not None
    # Recompute prefills prompt + the kept output in one chunk and samples the next token.
    assert list(recompute.token_ids) == new.prompt_token_ids + kept
    assert recompute.start_pos == 0 and recompute.sample
    assert old.num_preemptions == 0 and new.num_preemptions == 1
    assert len(new.output_token_ids) == 9 and len(old.output_token_ids) == 9
    assert sched.pool.stats().free_pages == 6 and len(sched.waiting) == 0


# ---- end to end with the fake paged model ------------------------------------------------------


@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("prefetch", [False, True])
def test_outputs_match_running_alone(seed, prefetch):
    """Random mix (adapters, base, long prompts, prompt logprobs, EOS) in a tight pool; with
    prefetch, waiting requests' adapters also go into free pages ahead of admission."""
    rng = random.Random(seed)
    sched = make_scheduler(
        num_pages=24,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_loras=3,
        max_adapter_wait_steps=2,
        max_model_len=48,
        prefetch_adapters=prefetch,
    )
    adapters = [None, "A", "B", "C", "D", "E"]
    adapter_pages = {a: rng.randint(1, 3) for a in adapters}
    expected = {}

    def arrivals(step, sched):
        for _ in range(rng.choice([0, 1, 1, 2]) if step < 30 else 0):
            rid = f"r{len(expected)}"
            adapter = rng.choice(adapters)
            seq = make_seq(
                rid,
                rng.randint(1, 30),
                rng.randint(1, 16),
                adapter,
                adapter_pages[adapter],
                rng,
                wants_prompt_logprobs=rng.random() < 0.3,
            )
            seq.max_tokens = min(seq.max_tokens, 48 - seq.num_prompt_tokens)
            sched.add(seq)
            expected[rid] = reference_output(seq, use_eos=True)

    outputs, finished, plans = drive(sched, arrivals, min_steps=30, use_eos=True)
    assert outputs == expected
    prompt_rows = {}  # every prompt logprob row is returned exactly once, even after preemption
    for e in (e for p in plans for e in p.entries):
        prompt_rows.setdefault(e.completion_id, []).extend(
            e.start_pos + r for r in e.logit_rows[: e.num_prompt_logit_rows]
        )
    for rid, seq in finished.items():
        want = list(range(seq.num_prompt_tokens - 1)) if seq.wants_prompt_logprobs else []
        assert prompt_rows.get(rid, []) == want, rid
    for rid, seq in finished.items():
        want = "stop" if expected[rid][-1] == EOS else "length"
        assert seq.status.finish_reason == want
    assert sum(len(p.preempted) for p in plans) > 0, "the pool was meant to be tight"
    s = sched.pool.stats()
    assert s.kv_pages == 0 and s.adapter_pages_pinned == 0
    assert s.free_pages + s.adapter_pages_idle == 24 and s.adapter_evictions > 0
    assert any(p.prefetch for p in plans) == prefetch


def test_prompt_logprob_rows():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq("p", 10, max_tokens=2, wants_prompt_logprobs=True)
    sched.add(seq)
    rows = []
    for _ in range(3):
        plan = sched.schedule()
        e = plan.entries[0]
        rows.append((e.start_pos, e.logit_rows, e.num_prompt_logit_rows, e.sample))
        sched.on_step_done(plan, {"p": 1} if e.sample else {})
    # positions 0..8 predict prompt tokens 1..9; position 9 samples; the decode samples only
    assert rows == [
        (0, tuple(range(8)), 8, False),
        (8, (0, 1), 1, True),
        (10, (0,), 0, True),
    ]


# ---- requests in and out -----------------------------------------------------------------------


def test_abort_frees_pages_and_pins():
    sched = make_scheduler(num_pages=16)
    sched.add(make_seq("a", 9, adapter="A", pages=3))
    sched.add(make_seq("w", 5))
    plan = sched.schedule()
    sched.on_step_done(plan, {e.completion_id: 2 for e in plan.entries})
    assert sched.pool.refcount("A") == 1 and sched.pool.stats().kv_pages == 3 + 2
    assert sched.abort("a") is not None and sched.abort("w") is not None
    assert sched.abort("a") is None  # already done
    s = sched.pool.stats()
    assert (s.kv_pages, s.adapter_pages_pinned, s.adapter_pages_idle) == (0, 0, 3)
    assert not sched.has_unfinished()


def test_step_results_advance_and_end_sequences():
    sched = make_scheduler()
    sched.add(make_seq("a", 5))
    sched.add(make_seq("b", 3, adapter=7, pages=2))
    plan = sched.schedule()
    assert plan.lora_slots == [(0, 7, plan.adapters[0].pages)]
    with pytest.raises(AssertionError, match="sampled"):  # a bug in the engine: no change
        sched.on_step_done(plan, {"a": 1})
    assert sched.get("a").num_computed_tokens == 0
    done = sched.on_step_done(plan, {"a": 1, "b": 2}, {"b": "</s>"})
    assert [s.completion_id for s in done] == ["b"] and done[0].status.finish_reason == "stop"
    assert done[0].stop_reason == "</s>"
    assert sched.get("a").num_computed_tokens == 5 and sched.pool.refcount(7) == 0


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(4\\) must be >= max_num_seqs"):
        EngineConfig(num_pages=8, max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="max_loras must be a positive integer, got 0"):
        EngineConfig(num_pages=8, max_loras=0)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_pages=8, pool_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="max_cpu_loras \\(2\\) must be >= max_loras \\(4\\)"):
        EngineConfig(num_pages=8, max_loras=4, max_cpu_loras=2)
    manifest = C.ModelManifest(
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=3,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=512,
        block_size=8,
        dtype="float32",
        device="cpu",
        lora_targets={},
        eos_token_ids=[2],
    )
    page = 3 * 2 * 8 * 2 * 16 * 4  # layers x K|V x block_size x kv_heads x head_dim x 4 bytes
    cfg = EngineConfig(pool_memory_bytes=10 * page + page // 2).resolved(manifest)
    assert (cfg.num_pages, cfg.pool_memory_bytes, cfg.max_model_len) == (10, None, 512)
    assert cfg.block_size == 8
    with pytest.raises(ValueError, match="build it from config.resolved\\(manifest\\)"):
        Scheduler(EngineConfig(num_pages=8), PagePool(8))
    with pytest.raises(ValueError, match="block_size 16 does not match the exported .* 8"):
        EngineConfig(num_pages=4, block_size=16).resolved(manifest)
    with pytest.raises(ValueError, match="max_model_len 600 exceeds .* 512"):
        EngineConfig(num_pages=4, block_size=8, max_model_len=600).resolved(manifest)
    with pytest.raises(ValueError, match="holds no page"):
        EngineConfig(pool_memory_bytes=page - 1, block_size=8).resolved(manifest)


def test_default_pool_follows_free_memory_and_the_model():
    """Default pool: 10 % of the memory available beyond the weights, within [256 MiB, 4 GiB];
    CUDA pools keep 512 MiB; a given fraction overrides; max_loras defaults to the pool bound."""
    from ort_lora import config as cfgmod

    manifest = C.ModelManifest(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=2, hidden_size=64,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=100,
        max_position_embeddings=512, block_size=8, dtype="float32", device="cpu",
        lora_targets={}, eos_token_ids=[2],
    )  # fmt: skip
    weights = cfgmod.weight_bytes(manifest)
    gib = 1 << 30
    assert cfgmod.default_pool_bytes(manifest, 0.1, 20 * gib + weights) == 2 * gib
    assert cfgmod.default_pool_bytes(manifest, 0.1, gib) == cfgmod.POOL_FLOOR_BYTES
    assert cfgmod.default_pool_bytes(manifest, 0.5, 100 * gib) == cfgmod.POOL_CAP_BYTES
    cuda = C.ModelManifest(**{**manifest.__dict__, "device": "cuda"})
    assert cfgmod.default_pool_bytes(cuda, 0.1, 100 * gib) == cfgmod.DEFAULT_POOL_BYTES
    cfg = EngineConfig()
    assert (cfg.pool_memory_fraction, cfg.max_loras, cfg.max_cpu_loras) == (0.1, None, None)
    resolved = EngineConfig(pool_memory_fraction=0.01).resolved(manifest)
    assert resolved.max_cpu_loras == cfgmod.CPU_HOST_LORAS == 0  # the CPU pool holds them
    assert EngineConfig(max_loras=8).resolved(cuda).max_cpu_loras == 32
    assert resolved.num_pages >= cfgmod.POOL_FLOOR_BYTES // cfgmod.page_bytes(manifest)
    assert resolved.max_loras == resolved.num_pages  # no cap beyond the pool
    capped = EngineConfig(max_loras=3).resolved(manifest)
    assert (capped.max_loras, capped.max_cpu_loras) == (3, 0)  # an upper bound; no host copies
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= 0, got -1"):
        EngineConfig(max_cpu_loras=-1)
    with pytest.raises(ValueError, match="pool_memory_fraction must be in \\(0, 0.9\\], got 2"):
        EngineConfig(pool_memory_fraction=2)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(pool_memory_bytes=1 << 20, pool_memory_fraction=0.1)
