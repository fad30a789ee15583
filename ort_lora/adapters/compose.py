"""Weighted composition of adapters per request, as graph inputs (contract.py, "Composition and
DoRA"). Pure functions over numpy.

A request may compose adapters a_1..a_k with weights w_1..w_k: its rows get
sum_i w_i s_i B_i (A_i x), PEFT's add_weighted_adapter(..., combination_type="cat") without a
merge. In a step, the request's rows form one segment (lora_seg_starts), and the segment's
terms are (slot of a_i, w_i). `segment_inputs` turns every segment's terms into
lora_seg_slots and the lora_comp_* entries: a segment of one adapter at weight 1 is a plain
segment (its slot in lora_seg_slots, no entry); any other segment has slot -1 and one entry per
term. DoRA adapters (use_dora) are never composed: their magnitude rescales the whole module
output for one adapter, and PEFT defines no composition of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ort_lora import contract as C
from ort_lora.adapters.errors import CompositionError
from ort_lora.lora_request import shown, weight_problem

Terms = Sequence[tuple[int, float]]  # (adapter slot or id, weight), in order


def check_weights(terms: Terms, names: Sequence[str], max_adapters: int | None) -> None:
    """CompositionError naming the problem: no adapter, more than max_adapters, an adapter twice, a
    weight that is not a number (a bool, a string) or not finite or |weight| > MAX_WEIGHT
    (lora_request.weight_problem: LoraSGMV reads weights as float32). names[i] names terms[i]'s
    adapter."""
    if not terms:
        raise CompositionError("a composition names no adapter: expected one or more")
    if max_adapters is not None and len(terms) > max_adapters:
        raise CompositionError(
            f"a composition of {len(terms)} adapters ({', '.join(names)}) exceeds max_loras = "
            f"{max_adapters}: every composed adapter is resident at once"
        )
    seen = set()
    for (key, weight), name in zip(terms, names, strict=True):
        if key in seen:
            raise CompositionError(f"adapter {name!r} appears twice in one composition")
        seen.add(key)
        problem = weight_problem(weight)
        if problem is not None:
            raise CompositionError(f"adapter {name!r}: weight {shown(weight)} {problem}")


def is_plain(terms: Terms) -> bool:
    """One adapter at weight 1: served as an ordinary (uncomposed) segment."""
    return len(terms) == 1 and float(terms[0][1]) == 1.0


def segment_inputs(segments: Sequence[Terms], dora_slots: set[int]) -> dict[str, np.ndarray]:
    """lora_seg_slots int32 [S] and lora_comp_segs / lora_comp_slots int32 [E],
    lora_comp_weights float32 [E] for every segment's (slot, weight) terms (base rows: no
    terms). ValueError for a composed segment holding a DoRA slot or a weight out of range
    (check_weights refuses such requests before they are queued)."""
    seg_slots = np.full(len(segments), -1, np.int32)
    comp: list[tuple[int, int, float]] = []
    for s, terms in enumerate(segments):
        if is_plain(terms):
            seg_slots[s] = terms[0][0]
            continue
        for slot, weight in terms:
            if slot in dora_slots:
                raise ValueError(f"segment {s} composes the DoRA adapter in slot {slot}")
            problem = weight_problem(weight)
            if problem is not None:
                raise ValueError(f"segment {s}: weight {shown(weight)} of slot {slot} {problem}")
            comp.append((s, slot, float(weight)))
    return {C.LORA_SEG_SLOTS: seg_slots, **composition_entries(comp)}


def composition_entries(comp: Sequence[tuple[int, int, float]] = ()) -> dict[str, np.ndarray]:
    """The lora_comp_* inputs of (segment, slot, weight) entries (none: no segment composes)."""
    segs, slots, weights = zip(*comp, strict=True) if comp else ((), (), ())
    return {
        C.LORA_COMP_SEGS: np.asarray(segs, np.int32),
        C.LORA_COMP_SLOTS: np.asarray(slots, np.int32),
        C.LORA_COMP_WEIGHTS: np.asarray(weights, np.float32),
    }
