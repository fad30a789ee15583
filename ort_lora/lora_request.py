"""LoRARequest: names the adapter a request runs with (vLLM's offline-API value type)."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

# The largest |weight| of a composed adapter. PEFT takes any float, but a weight is a plain
# multiplier of the adapter's delta (usually in [-2, 2]); past a few hundred the output is
# noise. 1000 keeps weight * scale * |B A x| (each adapter module's gain is at most
# adapters/bounds.py MAX_GAIN = 1e6 per unit of ||x||) some 1e20 under float32's largest value,
# and every weight is exact enough in float32, the type LoraSGMV's comp_weights has.
MAX_WEIGHT = 1000.0


def weight_problem(weight) -> str | None:
    """Why `weight` cannot weigh a composed adapter (None: it can): it must be a real number,
    not a bool nor a string, with |weight| <= MAX_WEIGHT (so finite in float32)."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        return "is not a number"
    try:
        value = float(weight)
    except (OverflowError, ValueError):
        return f"is out of range: |weight| <= {MAX_WEIGHT:g}"
    if not math.isfinite(value):
        return "is not finite"
    if abs(value) > MAX_WEIGHT:
        return f"is out of range: |weight| <= {MAX_WEIGHT:g}"
    return None


def shown(value, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters: an error message echoes a client's value."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a huge int may raise
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as in vLLM: `LoRARequest("sql", 1, "/adapters/sql")`.

    lora_name: the adapter's public name (the OpenAI `model` field names it).
    lora_int_id: a unique positive integer id, stable for the adapter's lifetime.
    lora_path: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    weight: the adapter's weight w when a request composes adapters (a list of LoRARequests:
      its rows get sum_i w_i * s_i * B_i A_i x, PEFT's add_weighted_adapter(cat)); default
      1.0. One LoRARequest at a weight other than 1 is a composition of one adapter. Not part
      of the adapter's identity: requests that differ only in weight are equal. An int or
      float (bools and strings are refused) with |weight| <= MAX_WEIGHT; stored as a float.
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
        if weight_problem(self.weight) is not None:
            raise ValueError(
                f"adapter {self.lora_name!r}: weight must be a finite number with |weight| <= "
                f"{MAX_WEIGHT:g} (an int or float, not a bool or string), got "
                f"{shown(self.weight)}"
            )
        object.__setattr__(self, "weight", float(self.weight))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
