"""RunSpec: everything a worker process needs to run one system on one workload (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ort_lora.bench.workloads import Workload


@dataclass
class RunSpec:
    """One measured run.

    system:    a key of systems.RUNNERS
    label:     the row name in tables and plots, e.g. "ort-lora mixed"
    experiment: which table/plot the run belongs to (e.g. "systems", "popularity")
    models:    paths: hf (checkpoint), ort_lora (export), genai_base, genai_lora
    adapters:  PEFT adapter dir of each adapter index; genai_adapters: .onnx_adapter files
    threads:   intra-op threads of every runtime
    """

    system: str
    label: str
    experiment: str
    workload: dict
    models: dict[str, str]
    adapters: list[str] = field(default_factory=list)
    genai_adapters: list[str] = field(default_factory=list)
    threads: int = 2
    options: dict = field(default_factory=dict)

    @property
    def load(self) -> Workload:
        return Workload.from_json(self.workload)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @staticmethod
    def read(path: Path) -> RunSpec:
        return RunSpec(**json.loads(Path(path).read_text()))
