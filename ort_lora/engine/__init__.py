"""The serving engine. Pure bookkeeping (pool, sequences, scheduler, step plan, requests) plus
the loop that drives one ONNX Runtime session; nothing here imports torch, and only the model
runner's session imports onnxruntime. docs/ARCHITECTURE.md follows one request through it.

The loop, one `LLMEngine.step()` (the other modules' docstrings point here):

    plan = scheduler.schedule()          # a value: who runs which chunk, KV pages, adapter slots
    runner.load_adapters(plan)           # adapters placed this step: weights into their pages
    logits = runner.run(plan)            # graph inputs from the plan, one ORT run; should it
                                         # raise: isolation.py reruns the plan in halves, fails
                                         # the entries that fail alone, the rest go on
    sampled = sample(logits[sample rows], rows, rng)          # sampler.py, per-row settings
    postprocess: prompt logprobs, detokenize + stop rules (Completion.add_token),
                 done = scheduler.on_step_done(plan, tokens, stopped)   # length limits too
                 tracker.finish(done)    # the one finish path (request.py)

Between steps, on the same thread: add_request (check_request, then the sequences are queued),
abort_request, add_lora / remove_lora (the registry drains an adapter before it is gone).
Ids: a request has n completions; the scheduler's unit is the completion ("<request>#<i>").
Engine tests check engine/invariants.py after every step.
"""

from ort_lora.engine.pool import PagePool, PoolExhausted, PoolStats
from ort_lora.engine.scheduler import Scheduler, SchedulerStats
from ort_lora.engine.sequence import Sequence, SequenceStatus
from ort_lora.engine.step_plan import (
    BASE_SLOT,
    MetadataBuffers,
    ScheduledSeq,
    StepAdapter,
    StepPlan,
    base_plan,
    build_metadata,
    make_plan,
)

__all__ = [
    "BASE_SLOT",
    "MetadataBuffers",
    "PagePool",
    "PoolExhausted",
    "PoolStats",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StepAdapter",
    "StepPlan",
    "base_plan",
    "build_metadata",
    "make_plan",
]
