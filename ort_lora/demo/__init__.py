"""Demo LoRA adapters for the default model (SmolLM2-135M-Instruct) and the tasks they solve.

`demo_adapter_dirs()` maps each task name to its committed PEFT adapter directory;
`ort_lora.demo.tasks.TASKS` has the prompt generators and success checkers.
"""

from __future__ import annotations

from pathlib import Path


def demo_adapter_dirs() -> dict[str, Path]:
    """Task name -> directory of its committed PEFT adapter (adapter_config.json + safetensors)."""
    from ort_lora.demo.tasks import TASKS

    return {name: task.adapter_dir for name, task in TASKS.items()}
