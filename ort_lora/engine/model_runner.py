"""ModelRunner: one StepPlan through the model. Adapters the plan places are copied into their
pool pages, the plan becomes the graph's inputs (ort_lora/contract.py), ONNX Runtime runs.

    runner = ModelRunner(session, registry)
    failed = runner.load_adapters(plan)   # {adapter id: error} for files that no longer load
    logits = runner.run(plan)             # [plan.num_logit_rows, vocab]

A step in which no row has an adapter runs on the session's base graph when it has one
(runtime/base_graph.py), without the LoRA inputs. The engine drives it with the scheduler's
plans; export --verify and tests with hand-made ones (step_plan.base_plan) and no registry (no
adapters): the same path either way.
"""

from __future__ import annotations

import functools

import numpy as np

from ort_lora.adapters import AdapterError, AdapterRegistry
from ort_lora.engine.step_plan import MetadataBuffers, StepPlan, build_metadata
from ort_lora.timing import RUN, StepTimes


class ModelRunner:
    """A ModelSession (runtime/session.py) and the adapter registry that fills its pool."""

    def __init__(self, session, registry: AdapterRegistry | None = None):
        self.session = session
        self.registry = AdapterRegistry(session.manifest) if registry is None else registry
        self.block_size = session.manifest.block_size
        self.buffers = MetadataBuffers()

    def load_adapters(self, plan: StepPlan) -> dict[int, Exception]:
        """Copy the plan's loads (used by this step) and prefetches (not used by it) into
        their pages; {adapter id: error} for adapters whose files fail to load."""
        failed: dict[int, Exception] = {}
        todo = [(a, False) for a in plan.loads] + [(a, True) for a in plan.prefetch]
        for a, prefetch in todo:
            try:
                self.load_adapter(a.adapter_id, a.pages, prefetch)
            except (AdapterError, OSError) as e:
                failed[a.adapter_id] = e
        return failed

    def load_adapter(self, adapter_id: int, pages, prefetch: bool = False, adapter=None) -> None:
        """Copy one registered adapter into these pool pages (before the next run; prefetch:
        the next run does not use it; adapter: its host form in hand, else the registry's)."""
        write = functools.partial(self.registry.write_to_pool, adapter_id, adapter=adapter)
        self.session.load_adapter(adapter_id, pages, write, prefetch=prefetch)

    def run(self, plan: StepPlan, times: StepTimes | None = None) -> np.ndarray:
        """Logits of the plan's logit rows [plan.num_logit_rows, vocab]; `times` gets the
        "inputs" (host) and "run" (ONNX Runtime) phases."""
        times = times or StepTimes()
        adapters = plan.uses_adapters
        with times.phase("inputs"):
            inputs = build_metadata(plan, self.block_size, buffers=self.buffers)
            if adapters or self.session.base is None:
                segments = plan.segments if plan.has_composition else None
                slots, pages = plan.lora_slots, self.session.num_pages
                inputs.update(self.registry.lora_step_inputs(slots, pages, segments))
        with times.phase(RUN):
            return self.session.run(inputs, adapters=adapters)
