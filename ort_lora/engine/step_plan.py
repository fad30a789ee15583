"""StepPlan: what one forward pass runs (a value), and the graph metadata arrays it implies.

The scheduler returns a StepPlan; the model runner (model_runner.py) turns it into graph
inputs with `build_metadata(plan, block_size)` (numpy only) and the adapter registry's
per-module LoRA arrays for `plan.lora_slots` [(slot, adapter_id, pages)]. `base_plan` builds
a plan by hand, for running the model without a scheduler (export --verify, tests);
`sub_plan` one of some of a plan's entries (engine/isolation.py reruns a failed step's parts).

Ordering: entries are sorted by adapter slot, base requests (slot -1) FIRST, so every
adapter's tokens are one contiguous LoRA segment. Slots are 0..k-1 over this step's
distinct adapters. Within a slot, entries keep the scheduler's order (decodes first).
Composed entries (several adapters with weights: `terms`, slot -1) come last, grouped by
their terms, one segment per distinct composition; `plan.segments` gives every segment's
(slot, weight) terms for AdapterRegistry.lora_step_inputs.

Logits: each entry lists `logit_rows`, offsets inside its chunk whose logits the graph
returns, in order; the step's `logits` output has one row per listed offset, entry after
entry (entry i's rows start at `entries[i].logits_offset`). A chunk that reaches the end of
the sequence's tokens is sampled from its LAST logit row (`sample`); a prompt chunk of a
request that wants prompt logprobs also returns its prompt rows. A mid-prompt chunk without
prompt logprobs returns no row, so a step may return fewer rows than sequences (even 0).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from ort_lora import contract as C

BASE_SLOT = -1


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    completion_id: str  # the sequence's id ("<request_id>#<index>" in the engine)
    token_ids: tuple[int, ...]  # the new tokens run this step (a chunk, or 1 in decode)
    start_pos: int  # tokens already in the KV cache = position of token_ids[0]
    block_table: tuple[int, ...]  # pool pages of its KV blocks, in order
    slot: int  # adapter slot in this step, BASE_SLOT (-1) for the base model
    logit_rows: tuple[int, ...]  # offsets in token_ids whose logits are returned, ascending
    sample: bool  # the chunk reaches the end of the tokens: sample from the last logit row
    num_prompt_logit_rows: int = 0  # leading logit_rows that are prompt-logprob rows
    logits_offset: int = 0  # index of this entry's first row in the step's logits output
    terms: tuple[tuple[int, float], ...] = ()  # a composed entry's (slot, weight); slot -1

    @property
    def segment_key(self) -> tuple:
        """Entries of one LoRA segment share it; sorts base, slots 0..k-1, compositions."""
        return (1, self.terms) if self.terms else (0, self.slot)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sample_row(self) -> int | None:
        """Row of the step's logits output to sample from, None if nothing is sampled."""
        return self.logits_offset + len(self.logit_rows) - 1 if self.sample else None


@dataclass(frozen=True)
class StepAdapter:
    """An adapter used in this step: its slot, pool pages, and whether to copy it in first."""

    slot: int
    adapter_id: Hashable
    pages: tuple[int, ...]
    needs_load: bool  # its pages were just allocated: load the weights before the run


@dataclass(frozen=True)
class StepPlan:
    """One step: entries ordered by slot (base first), adapters by slot, preempted ids.

    prefetch: adapters of waiting requests put into free pages this step (slot -1, not used
    by the step): load them now; the step does not wait for their copies.
    """

    entries: tuple[ScheduledSeq, ...]
    adapters: tuple[StepAdapter, ...]
    preempted: tuple[str, ...] = ()  # completion ids
    prefetch: tuple[StepAdapter, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    @property
    def num_logit_rows(self) -> int:
        return sum(len(e.logit_rows) for e in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries

    @property
    def lora_slots(self) -> list[tuple[int, Hashable, tuple[int, ...]]]:
        """[(slot, adapter_id, pages)]: what AdapterRegistry.lora_step_inputs takes."""
        return [(a.slot, a.adapter_id, a.pages) for a in self.adapters]

    @property
    def uses_adapters(self) -> bool:
        """Some row has an adapter (or a composition of them)."""
        return any(_slots_of(e) for e in self.entries)

    @property
    def has_composition(self) -> bool:
        return any(e.terms for e in self.entries)

    @property
    def segments(self) -> list[list[tuple[int, float]]]:
        """Every LoRA segment's (slot, weight) terms, in lora_seg_starts order: [] for base
        rows, [(slot, 1.0)] for one adapter's, the terms of a composed segment."""
        out = []
        for i in _segment_firsts(self.entries):
            e = self.entries[i]
            out.append(list(e.terms) if e.terms else [] if e.slot < 0 else [(e.slot, 1.0)])
        return out

    @property
    def loads(self) -> tuple[StepAdapter, ...]:
        """Adapters whose weights must be copied into their pages before this step runs."""
        return tuple(a for a in self.adapters if a.needs_load)


def make_plan(
    entries: Iterable[ScheduledSeq],
    adapters: Iterable[StepAdapter],
    preempted: Iterable[str] = (),
    prefetch: Iterable[StepAdapter] = (),
) -> StepPlan:
    """Sort entries by segment (stable: base first, then slots, then compositions) and set
    each entry's logits_offset."""
    ordered, offset = [], 0
    for e in sorted(entries, key=lambda e: e.segment_key):
        ordered.append(replace(e, logits_offset=offset))
        offset += len(e.logit_rows)
    slots = sorted(adapters, key=lambda a: a.slot)
    assert [a.slot for a in slots] == list(range(len(slots))), "adapter slots must be 0..k-1"
    return StepPlan(tuple(ordered), tuple(slots), tuple(preempted), tuple(prefetch))


def sub_plan(plan: StepPlan, entries: Iterable[ScheduledSeq]) -> StepPlan:
    """A plan of some of `plan`'s entries (fault isolation reruns parts of a failed step):
    the adapters they use, renumbered 0..k-1 in slot order, none to load (the step loaded
    them), no preemptions or prefetches; logits_offset set afresh."""
    entries = list(entries)
    used = sorted({s for e in entries for s in _slots_of(e)})
    new = {old: i for i, old in enumerate(used)}
    adapters = [replace(plan.adapters[old], slot=new[old], needs_load=False) for old in used]
    moved = [
        replace(e, slot=new.get(e.slot, e.slot), terms=tuple((new[s], w) for s, w in e.terms))
        for e in entries
    ]
    return make_plan(moved, adapters)


def _slots_of(e: ScheduledSeq) -> list[int]:
    """The step's adapter slots an entry runs with (its own, or each composed term's)."""
    return [e.slot] * (e.slot >= 0) + [s for s, _ in e.terms]


def base_plan(*seqs: tuple, block_size: int) -> StepPlan:
    """A plan of base-model sequences given by hand: each (token_ids, start_pos, block_table)
    or (token_ids, start_pos, block_table, logit_rows); default logit row: the last token.

    Token i of a sequence sits at position start_pos + i, in page
    block_table[position // block_size]. Nothing is sampled (`sample` is False).
    """
    entries = []
    for b, (ids, start, table, *rows) in enumerate(seqs):
        if not ids or start < 0:
            raise ValueError(f"sequence {b}: needs new tokens and start_pos >= 0, got {start}")
        last = start + len(ids) - 1
        if last // block_size >= len(table):
            raise ValueError(
                f"sequence {b}: {len(ids)} tokens at position {start} need "
                f"{last // block_size + 1} blocks of {block_size}, its block table has "
                f"{len(table)}"
            )
        rows = tuple(rows[0]) if rows else (len(ids) - 1,)
        entries.append(
            ScheduledSeq(str(b), tuple(ids), start, tuple(table), BASE_SLOT, rows, False)
        )
    return make_plan(entries, [])


class MetadataBuffers:
    """Reusable flat buffers; build_metadata returns C-contiguous views into them.

    The views stay valid (and their addresses stable while capacity suffices) until the next
    build_metadata call with the same buffers, which overwrites them.
    """

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def put(self, name: str, values: np.ndarray, dtype) -> np.ndarray:
        """Copy values into the named buffer (grown on demand); return a same-shape view."""
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.size < values.size:
            buf = np.empty(max(values.size, 2 * (0 if buf is None else buf.size)), dtype)
            self._bufs[name] = buf
        view = buf[: values.size].reshape(values.shape)
        np.copyto(view, values, casting="unsafe")
        return view


def build_metadata(
    plan: StepPlan,
    block_size: int,
    *,
    max_blocks: int | None = None,
    buffers: MetadataBuffers | None = None,
) -> dict[str, np.ndarray]:
    """Graph inputs of ort_lora.contract for a plan, except the per-module LoRA arrays.

    Returns (T tokens, B = len(plan.entries), R = plan.num_logit_rows, S segments):
      input_ids int64 [T], position_ids int64 [T], cumulative_sequence_length int32 [B+1],
      past_seqlens int32 [B], block_table int32 [B, W] padded with -1 (W = max_blocks or the
      longest table), slot_mapping int32 [T], attention_metadata int32 [3] (max new tokens,
      max kv length, max kv length), logits_indices int64 [R],
      lora_seg_starts int32 [S+1], lora_seg_slots int32 [S] (one segment per slot, -1 = base
      or composed: the registry's lora_step_inputs(..., plan.segments) fills those in).
    """
    if plan.is_empty:
        raise ValueError("build_metadata: the plan schedules no sequence")
    bufs = buffers or MetadataBuffers()
    entries = plan.entries
    lens = np.array([e.num_tokens for e in entries], np.int64)  # [B]
    starts = np.array([e.start_pos for e in entries], np.int64)  # [B]
    cu = np.concatenate([[0], np.cumsum(lens)])  # [B+1]
    seq_of_tok = np.repeat(np.arange(len(entries)), lens)  # [T]
    positions = starts[seq_of_tok] + np.arange(cu[-1]) - cu[seq_of_tok]  # [T]
    table = _block_table(entries, block_size, max_blocks)  # [B, W]
    kv_max = int((starts + lens).max())  # longest sequence after this step
    pages = table[seq_of_tok, positions // block_size]  # [T]
    assert (pages >= 0).all(), "a token position lies beyond its sequence's block table"
    logit_rows = [cu[i] + np.array(e.logit_rows, np.int64) for i, e in enumerate(entries)]
    seg_starts, seg_slots = _segments(entries, cu)
    out = {
        C.INPUT_IDS: (np.concatenate([e.token_ids for e in entries]), np.int64),
        C.POSITION_IDS: (positions, np.int64),
        C.CU_SEQLENS: (cu, np.int32),
        C.PAST_SEQLENS: (starts, np.int32),
        C.BLOCK_TABLE: (table, np.int32),
        C.SLOT_MAPPING: (pages * block_size + positions % block_size, np.int32),
        C.ATTENTION_METADATA: ([lens.max(), kv_max, kv_max], np.int32),
        C.LOGITS_INDICES: (np.concatenate(logit_rows), np.int64),
        C.LORA_SEG_STARTS: (seg_starts, np.int32),
        C.LORA_SEG_SLOTS: (seg_slots, np.int32),
    }
    return {name: bufs.put(name, np.asarray(v), dt) for name, (v, dt) in out.items()}


def _block_table(entries, block_size: int, max_blocks: int | None) -> np.ndarray:
    """[B, W] int64 block tables padded with -1 (the attention op reads only needed blocks)."""
    width = max(len(e.block_table) for e in entries)
    if max_blocks is not None:
        if max_blocks < width:
            raise ValueError(f"max_blocks {max_blocks} < the longest block table ({width})")
        width = max_blocks
    table = np.full((len(entries), max(width, 1)), -1, np.int64)
    for i, e in enumerate(entries):
        table[i, : len(e.block_table)] = e.block_table
    return table


def _segment_firsts(entries) -> list[int]:
    """Index of the first entry of each run of equal segment keys (entries are sorted)."""
    keys = [e.segment_key for e in entries]
    return [i for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]


def _segments(entries, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token segment per run of equal segment keys: starts [S+1] and slots [S] (-1 for
    base and composed segments)."""
    first = np.array(_segment_firsts(entries), np.int64)  # [S]
    slots = np.array([entries[i].slot for i in first], np.int64)  # [S]
    return np.append(cu[first], cu[-1]), slots
