"""StepPlan ordering and the graph metadata arrays, checked against values worked out by hand."""

import numpy as np
import pytest

from ort_lora import contract as C
from ort_lora.engine import (
    MetadataBuffers,
    ScheduledSeq,
    StepAdapter,
    base_plan,
    build_metadata,
    make_plan,
)


def test_metadata_arrays_by_hand():
    bs = 4
    entries = [  # given out of slot order on purpose
        ScheduledSeq("w", (41, 42, 43), 2, (6, 1), 1, (0, 1, 2), True, 2),
        ScheduledSeq("y", (21, 22, 23), 0, (4,), 0, (2,), True),
        ScheduledSeq("x", (11, 12), 5, (7, 2), -1, (1,), True),
        ScheduledSeq("z", (31,), 3, (0, 5, 3), 0, (), False),
    ]
    adapters = [StepAdapter(1, "B", (8,), False), StepAdapter(0, "A", (9, 10), True)]
    plan = make_plan(entries, adapters, ())
    assert [e.completion_id for e in plan.entries] == ["x", "y", "z", "w"]
    assert [e.logits_offset for e in plan.entries] == [0, 1, 2, 2]
    assert [e.sample_row for e in plan.entries] == [0, 1, None, 4]
    assert [a.adapter_id for a in plan.adapters] == ["A", "B"] and plan.loads[0].pages == (9, 10)
    m = build_metadata(plan, bs, buffers=MetadataBuffers())
    # x: positions 5, 6 -> block 1 (page 2) offsets 1, 2 -> 9, 10
    # y: positions 0..2 -> page 4 -> 16, 17, 18;  z: position 3 -> page 0 offset 3 -> 3
    # w: positions 2, 3 -> page 6 -> 26, 27; position 4 -> block 1 (page 1) offset 0 -> 4
    want = {
        C.INPUT_IDS: [11, 12, 21, 22, 23, 31, 41, 42, 43],
        C.POSITION_IDS: [5, 6, 0, 1, 2, 3, 2, 3, 4],
        C.CU_SEQLENS: [0, 2, 5, 6, 9],
        C.PAST_SEQLENS: [5, 0, 3, 2],
        C.BLOCK_TABLE: [[7, 2, -1], [4, -1, -1], [0, 5, 3], [6, 1, -1]],
        C.SLOT_MAPPING: [9, 10, 16, 17, 18, 3, 26, 27, 4],
        C.ATTENTION_METADATA: [3, 7, 7],  # y and w add 3 tokens; x ends at 5 + 2
        C.LOGITS_INDICES: [1, 4, 6, 7, 8],
        C.LORA_SEG_STARTS: [0, 2, 6, 9],
        C.LORA_SEG_SLOTS: [-1, 0, 1],
    }
    assert set(m) == set(want)
    for name, values in want.items():
        assert m[name].tolist() == values, name
        assert m[name].flags.c_contiguous
    dtypes = {C.INPUT_IDS: np.int64, C.POSITION_IDS: np.int64, C.LOGITS_INDICES: np.int64}
    for name in want:
        assert m[name].dtype == dtypes.get(name, np.int32), name
    wide = build_metadata(plan, bs, max_blocks=5)[C.BLOCK_TABLE]
    assert wide.shape == (4, 5) and wide[1].tolist() == [4, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="max_blocks 2 < the longest block table \\(3\\)"):
        build_metadata(plan, bs, max_blocks=2)


def test_metadata_buffers_are_reused():
    buffers = MetadataBuffers()
    big = make_plan([ScheduledSeq("a", tuple(range(1, 9)), 0, (3, 4), -1, (7,), True)], [])
    small = make_plan([ScheduledSeq("b", (5,), 8, (1, 2, 6), -1, (0,), True)], [])
    first = build_metadata(big, 4, buffers=buffers)[C.SLOT_MAPPING]
    second = build_metadata(small, 4, buffers=buffers)[C.SLOT_MAPPING]
    assert np.shares_memory(first, second) and second.tolist() == [6 * 4 + 0]
    with pytest.raises(ValueError, match="schedules no sequence"):
        build_metadata(make_plan([], []), 4)


def test_base_plan_by_position():
    """A hand-made plan (export --verify, tests): token i of a sequence at start + i, in page
    table[pos // bs] row pos % bs; the last token's row unless logit rows are given."""
    bs = 8
    seqs = [([5, 6, 7], 0, [4]), ([9], 10, [2, 7]), (list(range(11)), 3, [1, 0], [0, 10])]
    m = build_metadata(base_plan(*seqs, block_size=bs), bs)
    slots, positions = [], []
    for ids, start, table, *_ in seqs:
        positions += [start + i for i in range(len(ids))]
        slots += [table[p // bs] * bs + p % bs for p in positions[-len(ids) :]]
    assert m[C.SLOT_MAPPING].tolist() == slots
    assert m[C.POSITION_IDS].tolist() == positions
    assert m[C.CU_SEQLENS].tolist() == [0, 3, 4, 15]
    assert m[C.LOGITS_INDICES].tolist() == [2, 3, 4, 14]
    assert m[C.BLOCK_TABLE].shape == (3, 2) and m[C.BLOCK_TABLE][1].tolist() == [2, 7]
    assert m[C.LORA_SEG_SLOTS].tolist() == [-1]
    assert m[C.ATTENTION_METADATA].tolist() == [11, 14, 14]  # 11 new tokens; 3 + 11 cached
    with pytest.raises(ValueError, match="need 2 blocks of 8, its block table has 1"):
        base_plan(([1] * (bs + 1), 0, [0]), block_size=bs)
    with pytest.raises(ValueError, match="needs new tokens"):
        base_plan(([], 0, [0]), block_size=bs)
