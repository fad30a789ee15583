"""LoRARequest: names the adapter a request runs with (vLLM's offline-API value type)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as in vLLM: `LoRARequest("sql", 1, "/adapters/sql")`.

    lora_name: the adapter's public name (the OpenAI `model` field names it).
    lora_int_id: a unique positive integer id, stable for the adapter's lifetime.
    lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
