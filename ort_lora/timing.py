"""StepTimes: where one step's time went, phase by phase: the engine's (schedule, load,
inputs, grammar, run, sample, postprocess: /metrics and the benchmark's host share) and the
model session's own (bind, run, fetch). `with times.phase("run"): ...` adds the block's wall
time to that phase."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

RUN = "run"  # ONNX Runtime's run; every other phase is host work


@dataclass
class StepTimes:
    """Seconds per phase of one step; in the engine's, "grammar" is the part of structured
    outputs' mask work not hidden behind the run."""

    phases: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    num_seqs: int = 0

    def phase(self, name: str) -> _Phase:
        return _Phase(self.phases, name)

    @property
    def run_s(self) -> float:
        return self.phases.get(RUN, 0.0)

    @property
    def host_s(self) -> float:
        """Every phase but ONNX Runtime's run."""
        return sum(s for name, s in self.phases.items() if name != RUN)


class _Phase:
    """`with times.phase(name):` (a class, not @contextmanager: six per step, on the hot path)."""

    __slots__ = ("phases", "name", "start")

    def __init__(self, phases: dict[str, float], name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.start
        self.phases[self.name] = self.phases.get(self.name, 0.0) + elapsed
