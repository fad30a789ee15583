"""ort-lora: multi-LoRA LLM serving on ONNX Runtime."""

from ort_lora._lib import OPS_DOMAIN, library_path, session_options

__all__ = ["OPS_DOMAIN", "library_path", "session_options"]
__version__ = "0.1.0"
