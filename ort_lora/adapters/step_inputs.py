"""StepInputs: the per-step LoRA graph inputs from (slot, adapter, pages), cached.

An adapter's part of a step (per module: its pages' A and B offsets, ranks, scales, DoRA
offsets) depends only on its layout (adapters/layout.py: no weights needed) and its pages, so
it is cached per (adapter, pages, pool size); the whole step's tables are kept for the next
step, which in decode is usually the same."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping

import numpy as np

from ort_lora.adapters.compose import segment_inputs
from ort_lora.adapters.layout import SlotLayout, step_tables
from ort_lora.contract import ModelManifest

# (slot, adapter int id, pages) for each adapter slot of a step
StepSlots = list[tuple[int, int, tuple[int, ...]]]
# per segment of a step (lora_seg_starts order): its (slot, weight) terms; [] = base rows
StepSegments = list[list[tuple[int, float]]]
_MAX_STEP_ENTRIES = 1024


class StepInputs:
    def __init__(self, manifest: ModelManifest):
        self.manifest = manifest
        self._parts: OrderedDict[tuple, dict] = OrderedDict()
        self._last: tuple[tuple, dict[str, np.ndarray]] | None = None

    def inputs(
        self,
        slots: StepSlots,
        num_pages: int,
        segments: StepSegments | None,
        layouts: Mapping[int, SlotLayout],
        dora_ids: Container[int],
    ) -> dict[str, np.ndarray]:
        """AdapterRegistry.lora_step_inputs, for adapters given by int id (see there)."""
        key = (num_pages, tuple((int(s), a, tuple(int(p) for p in pg)) for s, a, pg in slots))
        if self._last is None or self._last[0] != key:
            slot_ids = [s for s, _, _ in key[1]]
            if len(set(slot_ids)) != len(slot_ids) or any(s < 0 for s in slot_ids):
                raise ValueError(f"step slots must be distinct and >= 0, got {slot_ids}")
            parts = {s: self._part(a, pages, num_pages, layouts[a]) for s, a, pages in key[1]}
            row_types = {s: layouts[a].row_type for s, a, _ in key[1]}
            tables = step_tables(parts, self.manifest, row_types)
            for array in tables.values():  # kept for later steps, which may bind them as they are
                array.setflags(write=False)
            self._last = (key, tables)
        out = self._last[1]  # with E = 0 composition entries if the export has them
        if segments is None:
            return out
        if "composition" not in self.manifest.lora_features:
            raise ValueError("this export has no composition inputs (manifest lora_features)")
        dora = {s for s, aid, _ in key[1] if aid in dora_ids}
        return out | segment_inputs(segments, dora)

    def forget(self, aid: int) -> None:
        """Drop what is cached of an adapter (unregistered)."""
        for key in [k for k in self._parts if k[0] == aid]:
            del self._parts[key]
        self._last = None

    def clear(self) -> None:
        self._parts.clear()
        self._last = None

    def _part(self, aid: int, pages: tuple, num_pages: int, layout: SlotLayout) -> dict:
        """module -> (a_off [R], b_off [R], ranks int32 [L], scales float32 [L], dora_off) for
        one slot (dora_off -1: no DoRA rows)."""
        key = (aid, pages, num_pages)
        if key in self._parts:
            self._parts.move_to_end(key)
            return self._parts[key]
        part = layout.part(pages, num_pages)  # no host copy needed
        self._parts[key] = part
        while len(self._parts) > _MAX_STEP_ENTRIES:
            self._parts.popitem(last=False)
        return part
