"""The engine's bookkeeping: unified page pool, sequences, scheduler, step plan.

Pure Python + numpy: nothing here imports onnxruntime or torch. The flow of one step is
documented at the top of scheduler.py. Wiring:

    config = EngineConfig(max_loras=4, pool_memory_bytes=1 << 30).resolved(manifest)
    pool = PagePool(config.num_pages)          # the session's pool has the same num_pages
    scheduler = Scheduler(config, pool)
    scheduler.add(Sequence(request_id, prompt_ids, params.max_tokens, lora_int_id,
                           registry.num_pages_needed(lora_int_id), params, wants_logprobs))
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
    "build_metadata",
    "make_plan",
]
