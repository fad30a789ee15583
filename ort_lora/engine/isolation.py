"""Fault isolation: after a step's model run fails, find the entries that make it fail.

    found = isolate(run, plan, error)   # run(plan) -> logits [rows, vocab], or raises
    found.failed                        # {completion id: error} of entries that fail ALONE
    found.survivors(keep)               # (plan, logits) of the entries whose runs succeeded
    probe(run, pool, block_size)        # None if a minimal base-model step runs, else why not

The engine (LLMEngine.step) calls these only after a failed run, so a step that succeeds
costs nothing more. `isolate` reruns the plan's entries in halves (sub-plans, recursively,
down to single entries): an entry fails only if its single-entry run fails (a step of one
entry is run once more), so a bad row fails its own request and every other entry of the
step goes on with logits of its own; a transient fault fails nobody.
Rerunning is safe: an entry writes the same KV values into the same slots (slot_mapping),
and nothing else changes until the engine samples the survivors, once.

When no entry runs even alone, `probe` tells a broken model or device (the probe fails:
a failed step) from requests at fault (it runs): the one token runs on the base model in a
page taken from the free list and given back before it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ort_lora.engine.pool import PagePool, PoolExhausted
from ort_lora.engine.step_plan import ScheduledSeq, StepPlan, base_plan, sub_plan

Run = Callable[[StepPlan], np.ndarray]  # the model run: logits [plan.num_logit_rows, vocab]
PROBE_TOKEN = 0  # any id of the vocabulary will do


@dataclass
class Isolated:
    """What isolating a failed step found: runs that succeeded and entries that fail alone."""

    plan: StepPlan  # the failed step's plan
    pieces: list[tuple[StepPlan, np.ndarray]] = field(default_factory=list)  # (sub-plan, logits)
    failed: dict[str, Exception] = field(default_factory=dict)  # completion id -> its error
    num_runs: int = 0  # model runs made while isolating

    def survivors(self, keep: Callable[[str], bool]) -> tuple[StepPlan, np.ndarray] | None:
        """One plan of the entries that ran and that `keep` (completion id) keeps, with
        their logits rows [plan.num_logit_rows, vocab] in its order; None if none is left
        (a request fails whole: its other completions' entries are dropped by `keep`)."""
        rows = {
            e.completion_id: logits[e.logits_offset : e.logits_offset + len(e.logit_rows)]
            for piece, logits in self.pieces
            for e in piece.entries
            if keep(e.completion_id)
        }
        if not rows:
            return None
        plan = sub_plan(self.plan, [e for e in self.plan.entries if e.completion_id in rows])
        return plan, np.concatenate([rows[e.completion_id] for e in plan.entries])


def isolate(run: Run, plan: StepPlan, error: Exception) -> Isolated:
    """Bisect a plan whose run raised `error` (see the module docstring)."""
    found = Isolated(plan)
    entries = list(plan.entries)
    _bisect(run, entries, error if len(entries) > 1 else None, found)  # one: retried once
    return found


def _bisect(run: Run, entries: list[ScheduledSeq], error: Exception | None, found: Isolated):
    """Run `entries` as one sub-plan unless `error` says they already failed together; split
    a failing group in halves, record a failing single entry."""
    if error is None:
        plan = sub_plan(found.plan, entries)
        found.num_runs += 1
        try:
            found.pieces.append((plan, run(plan)))
            return
        except Exception as exc:
            error = exc
    if len(entries) == 1:
        found.failed[entries[0].completion_id] = error
        return
    half = len(entries) // 2
    _bisect(run, entries[:half], None, found)
    _bisect(run, entries[half:], None, found)


def probe(run: Run, pool: PagePool, block_size: int) -> Exception | None:
    """Run one base-model token in a free page, given back at once; None if it runs, else
    the error (PoolExhausted when no page is free: the model stays unproven)."""
    if pool.num_free == 0:
        return PoolExhausted("the probe step found no free page")
    pages = pool.allocate_kv(1)  # from the free list: evicts no adapter
    try:
        run(base_plan(([PROBE_TOKEN], 0, pages), block_size=block_size))
    except Exception as exc:
        return exc
    finally:
        pool.free_kv(pages)
    return None
