"""ort-lora: multi-LoRA LLM serving on ONNX Runtime.

The serving API (LLM, SamplingParams, LoRARequest) is imported lazily so that
`import ort_lora` stays cheap for users who only need the op library.
"""

from ort_lora._lib import OPS_DOMAIN, library_path, session_options

__all__ = [
    "LLM",
    "LoRARequest",
    "OPS_DOMAIN",
    "SamplingParams",
    "StructuredOutputs",
    "library_path",
    "session_options",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "ort_lora.llm",
    "SamplingParams": "ort_lora.sampling_params",
    "StructuredOutputs": "ort_lora.sampling_params",
    "LoRARequest": "ort_lora.lora_request",
    "RequestOutput": "ort_lora.outputs",
    "CompletionOutput": "ort_lora.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ort_lora' has no attribute {name!r}")
