"""The engine's bookkeeping: unified page pool, sequences, scheduler, step plan.

Pure Python + numpy: nothing here imports onnxruntime or torch. The flow of one step is
documented at the top of scheduler.py.
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
