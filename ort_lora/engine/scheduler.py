"""Scheduler: continuous batching over the unified pool; each step yields a StepPlan (a value).

Its place in the engine loop is described in ort_lora/engine/__init__.py: `schedule()` makes
the plan, `on_step_done(plan, sampled, stopped)` advances the sequences after the run and
returns those that finished (pages freed, adapter pins released). `add(seq)` and
`abort(completion_id)` are called between steps, from the engine loop's thread. Sequences are
named by completion id; Sequence.adapter_id is the registry's int adapter id (None = base)
and Sequence.adapter_pages = registry.num_pages_needed(adapter_id). The engine validates a
request before it builds its sequences (engine/request.py: check_request), so everything
here that is wrong is a bug: assertions, not errors. A composed request's sequences have
Sequence.composition instead ((adapter id, pages, weight) per adapter): everything below that
says "its adapter" means every adapter it runs with (Sequence.adapters): each is pinned while
it runs, counts in the active set, and gets a slot; its rows form one segment per distinct
composition in the step (StepPlan.segments).

Rules of schedule() (every step, Orca-style continuous batching):
1. Decode first: every running sequence with one pending token runs it, oldest first. When
   its next KV block cannot be had (free + idle adapter pages), the NEWEST running sequence
   not yet scheduled this step is preempted by recompute (pages freed, adapter released,
   num_computed_tokens = 0, output kept, put at the FRONT of the waiting queue); this repeats
   until the block fits or the sequence itself was the newest and was preempted. Never failed.
2. Running prompts that are mid-prefill continue, oldest first, in chunks that fit the
   remaining token budget (max_num_batched_tokens). Their blocks were allocated at admission.
3. Admission (skipped in a step that preempted, so a victim is not re-admitted at once): the
   waiting queue is walked in order (preempted first, then arrival), while the step has
   budget and fewer than max_num_seqs run. A request is admitted when its adapters not yet
   active fit in the active set (distinct adapters of running requests; base never counts)
   without passing max_loras, AND the pool can give KV blocks for ALL its tokens plus its
   adapters' pages (pool.can_admit_all). Its first chunk runs this step. Memory is FIFO: a
   request that does not fit stops the walk, so later small requests cannot starve a long
   prompt.
   Adapter fairness: a request blocked only by the max_loras cap may be passed over by later
   requests of active adapters (or base), but only in max_adapter_wait_steps steps; after
   that the walk stops at it, active adapters drain, and the first slot that frees goes to
   it (or to an older request ahead of it in the queue).
   So a rare adapter waits at most max_adapter_wait_steps steps + one running request's
   lifetime, however many requests of popular adapters keep arriving.
4. Prefetch (config.prefetch_adapters): the waiting queue is walked in order once more and
   the adapters of up to max_loras still-waiting requests that are not resident are put into
   FREE pages or idle cached KV blocks' (never evicting an adapter; the walk stops at the
   first that does not fit). They are idle, so KV growth can still take their pages back;
   admitting their request later is a hit. The engine copies them in with this step's loads;
   on a GPU the copy overlaps with the step.
5. Prefix caching (config.enable_prefix_caching; sequences with a cache_salt: the engine
   sets it, engine/prefix_cache.py): at admission, the longest run of the prompt's leading
   full blocks found in the pool's cache is shared (never the block of the last token: its
   logits must be computed), so the request is admitted for its other blocks only and starts
   at the first token not cached. A request that wants prompt logprobs looks nothing up (its
   cached positions would have no logits); it still fills the cache. After each step, every
   block a sequence filled and computed is registered under its hash, so a sequence never
   writes into a shared block: shared blocks are full and before its first new token.
   Preemption and finishing drop the references; the cached blocks stay, idle, until a hit
   or eviction (engine/pool.py).
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from ort_lora.config import EngineConfig
from ort_lora.engine.pool import PagePool
from ort_lora.engine.prefix_cache import extend_hashes
from ort_lora.engine.sequence import Sequence, SequenceStatus
from ort_lora.engine.step_plan import BASE_SLOT, ScheduledSeq, StepAdapter, StepPlan, make_plan


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_preemptions: int  # total since start
    active_adapters: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_hits: int = 0  # of them, tokens found cached


class _Step:
    """The step being built: (sequence, chunk length) pairs, token budget, adapters loaded."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: list[tuple[Sequence, int]] = []
        self.ids: set[str] = set()  # completion ids
        self.loaded: set[Hashable] = set()

    def add(self, seq: Sequence, n: int) -> None:
        assert 0 < n <= self.budget, f"chunk of {n} tokens exceeds the budget for {seq}"
        self.items.append((seq, n))
        self.ids.add(seq.completion_id)
        self.budget -= n


class Scheduler:
    """Owns the waiting queue and running list; see the module docstring for the rules."""

    def __init__(self, config: EngineConfig, pool: PagePool):
        if config.block_size is None:
            raise ValueError(
                "Scheduler needs config.block_size; build it from config.resolved(manifest)"
            )
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: oldest first, newest last
        self.sequences: dict[str, Sequence] = {}  # completion id -> unfinished sequence
        self._arrivals = itertools.count()
        self._cap_waits: dict[str, int] = {}  # steps a sequence was passed over by the cap
        self.num_preemptions = 0
        self.caching = bool(config.enable_prefix_caching)
        # adapter id (None: base) -> [prompt tokens queried, found]; a composition counts
        # under each of its adapters
        self.prefix_counts: dict[Hashable | None, list[int]] = {}
        self._prefix_total = [0, 0]  # [queried, found] of every request

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new, checked sequence (see check_request): it fits the pool when alone."""
        assert seq.completion_id not in self.sequences, f"{seq.completion_id} is already queued"
        assert seq.status is SequenceStatus.WAITING and not seq.num_computed_tokens, seq
        seq.arrival = next(self._arrivals)
        self.sequences[seq.completion_id] = seq
        self.waiting.append(seq)

    def abort(self, completion_id: str) -> Sequence | None:
        """Cancel a sequence (waiting or running); None if it is unknown or already done."""
        seq = self.sequences.get(completion_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        else:
            self.waiting.remove(seq)
        self._forget(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def get(self, completion_id: str) -> Sequence | None:
        return self.sequences.get(completion_id)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            len(self.waiting),
            len(self.running),
            self.num_preemptions,
            len(self._active()),
            self._prefix_total[0],
            self._prefix_total[1],
        )

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Choose this step's sequences and chunks; allocate their pages. See module rules."""
        step = _Step(self.config.max_num_batched_tokens)
        preempted = self._schedule_decodes(step)
        self._schedule_prefills(step)
        if not preempted or not step.items:
            self._admit_waiting(step)
        prefetch = self._prefetch() if self.config.prefetch_adapters else []
        return self._plan(step, preempted, prefetch)

    def _schedule_decodes(self, step: _Step) -> list[str]:
        preempted: list[str] = []
        for seq in [s for s in self.running if s.num_pending_tokens == 1]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below as the victim of an older sequence
            while not self.pool.can_allocate(seq.blocks_needed(self.config.block_size)):
                victim = next(s for s in reversed(self.running) if s.completion_id not in step.ids)
                self._preempt(victim)
                preempted.append(victim.completion_id)
                if victim is seq:
                    break
            else:
                self._grow(seq)
                step.add(seq, 1)
        return preempted

    def _schedule_prefills(self, step: _Step) -> None:
        for seq in self.running:
            if step.budget == 0:
                return
            if seq.num_pending_tokens > 1:
                step.add(seq, min(seq.num_pending_tokens, step.budget))

    def _admit_waiting(self, step: _Step) -> None:
        active, blocked = self._active(), None
        for seq in list(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or step.budget == 0:
                break
            new = [a for a in seq.adapter_ids if a not in active]
            if new and len(active) + len(new) > self.config.max_loras:
                if self._cap_waits.get(seq.completion_id, 0) >= self.config.max_adapter_wait_steps:
                    break  # it has waited long enough: let active adapters drain for it
                blocked = blocked or seq
                continue
            hit = self._cached_prefix(seq)
            kv_pages = seq.blocks_needed(self.config.block_size) - len(hit)
            if not self.pool.can_admit_all(kv_pages, seq.adapters, hit):
                break
            self._admit(seq, step, hit)
            active.update(new)
        if blocked is not None and blocked.status is SequenceStatus.WAITING:
            cid = blocked.completion_id
            self._cap_waits[cid] = self._cap_waits.get(cid, 0) + 1

    def _admit(self, seq: Sequence, step: _Step, hit: list[int]) -> None:
        # the cached prefix first, then resident adapters: pinned, none of them can be
        # evicted to load the others
        self.pool.share_kv(hit)
        for aid, pages in sorted(seq.adapters, key=lambda a: not self.pool.is_resident(a[0])):
            _, needs_load = self.pool.acquire_adapter(aid, pages)
            if needs_load:
                step.loaded.add(aid)
        seq.block_table = list(hit)
        seq.num_cached_blocks = len(hit)
        seq.num_computed_tokens = len(hit) * self.config.block_size
        if not seq.num_preemptions:  # its first admission: what the API reports
            seq.num_cached_tokens = seq.num_computed_tokens
            self._count_lookup(seq)
        self._grow(seq)
        self.waiting.remove(seq)
        self._cap_waits.pop(seq.completion_id, None)
        seq.set_status(SequenceStatus.RUNNING)
        insort(self.running, seq, key=lambda s: s.arrival)
        step.add(seq, min(seq.num_pending_tokens, step.budget))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached run of the sequence's leading full blocks, short of
        the block of its last token (rule 5); [] when it takes no part in caching."""
        if not self.caching or seq.cache_salt is None or seq.wants_prompt_logprobs:
            return []
        bs = self.config.block_size
        blocks = (seq.num_tokens - 1) // bs
        extend_hashes(seq.block_hashes, seq.cache_salt, seq.token_ids, blocks, bs)
        return self.pool.lookup(seq.block_hashes[:blocks])

    def _count_lookup(self, seq: Sequence) -> None:
        if not self.caching or seq.cache_salt is None or seq.wants_prompt_logprobs:
            return
        counts = (seq.num_prompt_tokens, min(seq.num_cached_tokens, seq.num_prompt_tokens))
        for key in seq.adapter_ids or (None,):
            c = self.prefix_counts.setdefault(key, [0, 0])
            c[0], c[1] = c[0] + counts[0], c[1] + counts[1]
        self._prefix_total[0] += counts[0]
        self._prefix_total[1] += counts[1]

    def _cache_blocks(self, seq: Sequence) -> None:
        """Register the blocks the sequence has filled and computed since the last call."""
        bs = self.config.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if not self.caching or seq.cache_salt is None or full <= seq.num_cached_blocks:
            return
        extend_hashes(seq.block_hashes, seq.cache_salt, seq.token_ids, full, bs)
        for i in range(seq.num_cached_blocks, full):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i], seq.adapter_ids)
        seq.num_cached_blocks = full

    def _prefetch(self) -> list[StepAdapter]:
        out: list[StepAdapter] = []
        for aid, n in (a for seq in self.waiting for a in seq.adapters):
            if len(out) >= self.config.max_loras:
                break
            if self.pool.is_resident(aid):
                continue
            pages = self.pool.prefetch_adapter(aid, n)
            if pages is None:
                break
            out.append(StepAdapter(BASE_SLOT, aid, tuple(pages), needs_load=True))
        return out

    def _plan(self, step: _Step, preempted: list[str], prefetch: list[StepAdapter]) -> StepPlan:
        slots: dict[Hashable, int] = {}
        for seq, _ in step.items:
            for aid in seq.adapter_ids:
                slots.setdefault(aid, len(slots))
        adapters = [
            StepAdapter(slot, aid, tuple(self.pool.adapter_pages(aid)), aid in step.loaded)
            for aid, slot in slots.items()
        ]
        entries = [_entry(seq, n, slots) for seq, n in step.items]
        return make_plan(entries, adapters, preempted, prefetch)

    # ---- after the step ---------------------------------------------------------------------

    def on_step_done(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        stopped: Mapping[str, int | str | None] | None = None,
    ) -> list[Sequence]:
        """Advance the plan's sequences; return those that finished (pages already freed).

        sampled: completion id -> new token, for every entry with `sample`
        stopped: completion id -> stop reason (stop token id, stop string, None for EOS) of
                 the sampled sequences whose new token ends them: FINISHED_STOPPED. The
                 length limits (max_tokens, max_model_len) are applied here: FINISHED_LENGTH.
        """
        stopped = stopped or {}
        live = [e for e in plan.entries if e.completion_id in self.sequences]
        ids = [e.completion_id for e in live if e.sample]  # checked before any change
        assert len(ids) == len(sampled) and all(i in sampled for i in ids), f"sampled {sampled}"
        assert all(i in sampled for i in stopped), f"stopped {stopped} sampled nothing"
        done = []
        for e in live:  # (sequences aborted during the step, e.g. a failed request, are gone)
            seq = self.sequences[e.completion_id]
            self._advance(seq, e)
            self._cache_blocks(seq)
            if not e.sample:
                continue
            seq.append_token(sampled[e.completion_id])
            if e.completion_id in stopped:
                seq.stop_reason = stopped[e.completion_id]
                status = SequenceStatus.FINISHED_STOPPED
            else:
                status = self._length_status(seq)
            if status is not None:
                self._release(seq)
                self._forget(seq, status)
                done.append(seq)
        return done

    def _advance(self, seq: Sequence, e: ScheduledSeq) -> None:
        assert seq.num_computed_tokens == e.start_pos, f"{seq} ran out of order"
        seq.num_computed_tokens += e.num_tokens
        if seq.wants_prompt_logprobs:
            reached = min(seq.num_computed_tokens, seq.num_prompt_tokens - 1)
            seq.num_prompt_logits_done = max(seq.num_prompt_logits_done, reached)

    def _length_status(self, seq: Sequence) -> SequenceStatus | None:
        limit = self.config.max_model_len
        if len(seq.output_token_ids) >= seq.max_tokens or (limit and seq.num_tokens >= limit):
            return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- page bookkeeping -------------------------------------------------------------------

    def _active(self) -> set[Hashable]:
        return {aid for s in self.running for aid in s.adapter_ids}

    def _grow(self, seq: Sequence) -> None:
        need = seq.blocks_needed(self.config.block_size)
        if need > 0:
            seq.block_table.extend(self.pool.allocate_kv(need))

    def _release(self, seq: Sequence) -> None:
        """Give back a running sequence's KV pages and adapter pin."""
        self.pool.free_kv(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        for aid in seq.adapter_ids:
            self.pool.release_adapter(aid)
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.set_status(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _forget(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.set_status(status)
        del self.sequences[seq.completion_id]
        self._cap_waits.pop(seq.completion_id, None)


def _entry(seq: Sequence, n: int, slots: Mapping[Hashable, int]) -> ScheduledSeq:
    """The plan entry of a chunk of n tokens starting at seq.num_computed_tokens; slots: the
    step's slot of each adapter."""
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
    sample = end == seq.num_tokens
    rows: list[int] = []
    if seq.wants_prompt_logprobs:
        first = max(start, seq.num_prompt_logits_done)
        rows = [p - start for p in range(first, min(end, seq.num_prompt_tokens - 1))]
    num_prompt_rows = len(rows)
    if sample:
        rows.append(n - 1)
    return ScheduledSeq(
        completion_id=seq.completion_id,
        token_ids=tuple(seq.token_ids[start:end]),
        start_pos=start,
        block_table=tuple(seq.block_table),
        slot=slots.get(seq.adapter_id, BASE_SLOT),
        logit_rows=tuple(rows),
        sample=sample,
        num_prompt_logit_rows=num_prompt_rows,
        terms=tuple((slots[aid], w) for aid, _, w in seq.composition),
    )
