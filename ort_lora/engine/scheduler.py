"""Scheduler: continuous batching over the unified pool; each step yields a StepPlan (a value).

The engine loop, one step:

    plan = scheduler.schedule()                    # StepPlan, entries ordered by slot
    if plan.is_empty: wait for requests
    for a in plan.loads + plan.prefetch:           # copy weights into their fresh pages
        registry.write_to_pool(a.adapter_id, a.pages, session.pool)
    inputs = build_metadata(plan, block_size, buffers=buffers)
    inputs |= registry.lora_step_inputs(plan.lora_slots, num_pages)
    logits = session.run(inputs)                   # [plan.num_logit_rows, vocab]
    tokens = {e.request_id: sample(logits[e.sample_row]) for e in plan.entries if e.sample}
    finished = {rid: SequenceStatus.FINISHED_STOPPED for rid in tokens if stop(rid)}
    done = scheduler.on_step_done(plan, tokens, finished)   # frees pages, releases adapters

add(seq) and abort(request_id) are called between steps, from the engine loop's thread.
Sequence.adapter_id is the registry's int adapter id (LoRARequest.lora_int_id), None = base,
and Sequence.adapter_pages = registry.num_pages_needed(adapter_id).

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
   budget and fewer than max_num_seqs run. A request is admitted when its adapter is active
   or the active set (distinct adapters of running requests; base never counts) has fewer
   than max_loras, AND the pool can give KV blocks for ALL its tokens plus its adapter's
   pages (pool.can_admit). Its first chunk runs this step. Memory is FIFO: a request that
   does not fit stops the walk, so later small requests cannot starve a long prompt.
   Adapter fairness: a request blocked only by the max_loras cap may be passed over by later
   requests of active adapters (or base), but only in max_adapter_wait_steps steps; after
   that the walk stops at it, active adapters drain, and the first slot that frees goes to
   it (or to an older request ahead of it in the queue).
   So a rare adapter waits at most max_adapter_wait_steps steps + one running request's
   lifetime, however many requests of popular adapters keep arriving.
4. Prefetch (config.prefetch_adapters): the waiting queue is walked in order once more and
   the adapters of up to max_loras still-waiting requests that are not resident are put into
   FREE pages (never evicting anything; the walk stops at the first that does not fit). They
   are idle, so KV growth can still take their pages back; admitting their request later is
   a hit. The engine copies them in with this step's loads; on a GPU the copy overlaps with
   the step.
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from ort_lora.config import EngineConfig
from ort_lora.engine.pool import PagePool
from ort_lora.engine.sequence import Sequence, SequenceStatus
from ort_lora.engine.step_plan import BASE_SLOT, ScheduledSeq, StepAdapter, StepPlan, make_plan


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_preemptions: int  # total since start
    active_adapters: int


class _Step:
    """The step being built: (sequence, chunk length) pairs, token budget, adapters loaded."""

    def __init__(self, budget: int):
        self.budget = budget
        self.items: list[tuple[Sequence, int]] = []
        self.ids: set[str] = set()
        self.loaded: set[Hashable] = set()

    def add(self, seq: Sequence, n: int) -> None:
        assert 0 < n <= self.budget, f"chunk of {n} tokens exceeds the budget for {seq}"
        self.items.append((seq, n))
        self.ids.add(seq.request_id)
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
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._cap_waits: dict[str, int] = {}  # steps a request was passed over by the cap
        self.num_preemptions = 0

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. ValueError if its id is taken or it can never fit the pool."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"request {seq.request_id!r} is not a fresh sequence: {seq}")
        self._check_fits(seq)
        self._check_adapter_size(seq)
        seq.arrival = next(self._arrivals)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def _check_fits(self, seq: Sequence) -> None:
        limit, rid = self.config.max_model_len, seq.request_id
        if limit is not None and seq.num_prompt_tokens >= limit:
            raise ValueError(
                f"request {rid}: the prompt has {seq.num_prompt_tokens} tokens; "
                f"max_model_len is {limit} (prompt + output), so it must be shorter"
            )
        total = seq.num_prompt_tokens + seq.max_tokens
        total = total if limit is None else min(total, limit)
        blocks = -(-total // self.config.block_size)
        if blocks + seq.adapter_pages > self.pool.num_pages:
            raise ValueError(
                f"request {rid}: prompt + max_tokens = {total} tokens need {blocks} KV pages"
                f" + {seq.adapter_pages} adapter pages, more than the pool's "
                f"{self.pool.num_pages} pages; lower max_tokens or grow the pool"
            )

    def _check_adapter_size(self, seq: Sequence) -> None:
        """A resident adapter of another size is stale (reloaded with new weights): drop it
        if idle; if running requests still use it, refuse the request."""
        aid = seq.adapter_id
        if aid is None or not self.pool.is_resident(aid):
            return
        held = len(self.pool.adapter_pages(aid))
        if held != seq.adapter_pages and not self.pool.drop_adapter(aid):
            raise ValueError(
                f"request {seq.request_id}: adapter {aid!r} needs {seq.adapter_pages} pages "
                f"but running requests use it with {held}; wait for them or use a new id"
            )

    def abort(self, request_id: str) -> bool:
        """Cancel a request (waiting or running). False if it is unknown or already done."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        else:
            self.waiting.remove(seq)
        self._forget(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            len(self.waiting), len(self.running), self.num_preemptions, len(self._active())
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
                victim = next(s for s in reversed(self.running) if s.request_id not in step.ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
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
            aid = seq.adapter_id
            if aid is not None and aid not in active and len(active) >= self.config.max_loras:
                if self._cap_waits.get(seq.request_id, 0) >= self.config.max_adapter_wait_steps:
                    break  # it has waited long enough: let active adapters drain for it
                blocked = blocked or seq
                continue
            kv_pages = seq.blocks_needed(self.config.block_size)
            if not self.pool.can_admit(kv_pages, aid, seq.adapter_pages):
                break
            self._admit(seq, step)
            if aid is not None:
                active.add(aid)
        if blocked is not None and blocked.status is SequenceStatus.WAITING:
            self._cap_waits[blocked.request_id] = self._cap_waits.get(blocked.request_id, 0) + 1

    def _admit(self, seq: Sequence, step: _Step) -> None:
        if seq.adapter_id is not None:
            _, needs_load = self.pool.acquire_adapter(seq.adapter_id, seq.adapter_pages)
            if needs_load:
                step.loaded.add(seq.adapter_id)
        self._grow(seq)
        self.waiting.remove(seq)
        self._cap_waits.pop(seq.request_id, None)
        seq.set_status(SequenceStatus.RUNNING)
        insort(self.running, seq, key=lambda s: s.arrival)
        step.add(seq, min(seq.num_pending_tokens, step.budget))

    def _prefetch(self) -> list[StepAdapter]:
        out: list[StepAdapter] = []
        for seq in self.waiting:
            aid = seq.adapter_id
            if len(out) >= self.config.max_loras:
                break
            if aid is None or self.pool.is_resident(aid):
                continue
            pages = self.pool.prefetch_adapter(aid, seq.adapter_pages)
            if pages is None:
                break
            out.append(StepAdapter(BASE_SLOT, aid, tuple(pages), needs_load=True))
        return out

    def _plan(self, step: _Step, preempted: list[str], prefetch: list[StepAdapter]) -> StepPlan:
        slots: dict[Hashable, int] = {}
        for seq, _ in step.items:
            if seq.adapter_id is not None:
                slots.setdefault(seq.adapter_id, len(slots))
        adapters = [
            StepAdapter(slot, aid, tuple(self.pool.adapter_pages(aid)), aid in step.loaded)
            for aid, slot in slots.items()
        ]
        entries = [_entry(seq, n, slots.get(seq.adapter_id, BASE_SLOT)) for seq, n in step.items]
        return make_plan(entries, adapters, preempted, prefetch, self.pool.take_evicted())

    # ---- after the step ---------------------------------------------------------------------

    def on_step_done(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        finished: Mapping[str, SequenceStatus] | None = None,
    ) -> list[Sequence]:
        """Advance the plan's sequences; return those that finished (pages already freed).

        sampled:  request id -> token, for every entry with `sample` (aborted ones skipped)
        finished: request id -> FINISHED_STOPPED (EOS, stop token or string) for sampled ids;
                  max_tokens / max_model_len end a sequence as FINISHED_LENGTH here.
        """
        finished = dict(finished or {})
        self._check_results(plan, sampled, finished)
        done = []
        for e in plan.entries:
            seq = self.requests.get(e.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted after schedule()
            self._advance(seq, e)
            if e.sample:
                seq.append_token(sampled[e.request_id])
                status = finished.get(e.request_id) or self._length_status(seq)
                if status is not None:
                    self._release(seq)
                    self._forget(seq, status)
                    done.append(seq)
        return done

    def _check_results(self, plan: StepPlan, sampled: Mapping, finished: Mapping) -> None:
        """ValueError, before any change, if the engine's results do not match the plan."""
        sampled_ids = {e.request_id for e in plan.entries if e.sample}
        unknown = (set(sampled) | set(finished)) - sampled_ids
        if unknown:
            raise ValueError(f"on_step_done: requests {sorted(unknown)} sampled nothing in plan")
        live = {r for r in sampled_ids if r in self.requests}
        if live - set(sampled):
            raise ValueError(f"on_step_done: no sampled token for {sorted(live - set(sampled))}")
        bad = {r: s for r, s in finished.items() if not s.is_finished}
        if bad:
            raise ValueError(f"on_step_done: finished statuses must be FINISHED_*, got {bad}")

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
        return {s.adapter_id for s in self.running if s.adapter_id is not None}

    def _grow(self, seq: Sequence) -> None:
        need = seq.blocks_needed(self.config.block_size)
        if need > 0:
            seq.block_table.extend(self.pool.allocate_kv(need))

    def _release(self, seq: Sequence) -> None:
        """Give back a running sequence's KV pages and adapter pin."""
        self.pool.free_kv(seq.block_table)
        seq.block_table = []
        if seq.adapter_id is not None:
            self.pool.release_adapter(seq.adapter_id)
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.set_status(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _forget(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.set_status(status)
        del self.requests[seq.request_id]
        self._cap_waits.pop(seq.request_id, None)


def _entry(seq: Sequence, n: int, slot: int) -> ScheduledSeq:
    """The plan entry of a chunk of n tokens starting at seq.num_computed_tokens."""
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
        request_id=seq.request_id,
        token_ids=tuple(seq.token_ids[start:end]),
        start_pos=start,
        block_table=tuple(seq.block_table),
        slot=slot,
        logit_rows=tuple(rows),
        sample=sample,
        num_prompt_logit_rows=num_prompt_rows,
    )
