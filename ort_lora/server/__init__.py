"""HTTP server: OpenAI-compatible API over the engine (`ort-lora serve`)."""

from ort_lora.server.app import create_app

__all__ = ["create_app"]
