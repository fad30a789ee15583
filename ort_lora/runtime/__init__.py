"""Running an exported model: the step session (session.py)."""

from ort_lora.runtime.session import ModelSession

__all__ = ["ModelSession"]
