"""LoRARequest: names the adapter a request runs with (vLLM's offline-API value type)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as in vLLM: `LoRARequest("sql", 1, "/adapters/sql")`.

    lora_name: the adapter's public name (the OpenAI `model` field names it).
    lora_int_id: a unique positive integer id, stable for the adapter's lifetime.
    lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    weight: the adapter's weight w when a request composes adapters (a list of LoRARequests:
      its rows get sum_i w_i * s_i * B_i A_i x, PEFT's add_weighted_adapter(cat)); default
      1.0. One LoRARequest at a weight other than 1 is a composition of one adapter. Not part
      of the adapter's identity: requests that differ only in weight are equal.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    weight: float = field(default=1.0, compare=False)

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
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(
                f"adapter {self.lora_name!r}: weight must be a finite number, got {w!r}"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
