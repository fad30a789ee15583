"""PEFT LoRA adapters: parsing and validation, host form, pool layout, registry."""

from ort_lora.adapters.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterPathError,
    CompositionError,
)
from ort_lora.adapters.host import HostAdapter, ModuleWeights, load_adapter
from ort_lora.adapters.layout import SlotLayout, packing, write_to_pool
from ort_lora.adapters.peft_config import PeftLoraConfig, read_config
from ort_lora.adapters.registry import AdapterRegistry

__all__ = [
    "AdapterError",
    "AdapterNotFoundError",
    "AdapterPathError",
    "AdapterRegistry",
    "CompositionError",
    "HostAdapter",
    "ModuleWeights",
    "PeftLoraConfig",
    "SlotLayout",
    "load_adapter",
    "packing",
    "read_config",
    "write_to_pool",
]
