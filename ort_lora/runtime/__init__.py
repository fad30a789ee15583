"""Running an exported model: the step session (session.py)."""

from ort_lora.runtime.session import ModelSession, SequenceStep, StepTiming, build_step_inputs

__all__ = ["ModelSession", "SequenceStep", "StepTiming", "build_step_inputs"]
