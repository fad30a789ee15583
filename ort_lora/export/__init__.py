"""`ort-lora export`: Hugging Face checkpoint / GGUF -> ONNX model directory (see exporter.py)."""

from ort_lora.export.errors import ExportError
from ort_lora.export.exporter import export_model

__all__ = ["ExportError", "export_model"]
