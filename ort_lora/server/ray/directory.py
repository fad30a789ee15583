"""AdapterDirectory: the cluster-wide adapter registry of `ort-lora serve --ray`, and the board
where replicas post their figures. Runs as one named Ray actor per application (ray/serve.py);
the class itself is plain Python (no Ray), so its tests need no cluster.

Adapters: name -> LoRARequest with a cluster-wide int id (ids are never reused, so a name
unloaded and loaded again is told apart from its old registration). `--lora-modules`
adapters are given at construction, so an actor Ray restarts comes back with them; adapters
loaded at run time are lost with the actor (docs/SCALE_OUT.md: failure behaviour).

`version` counts changes to the adapters, so a reader can tell a stale snapshot from a newer
one.

Reports: each replica posts {engine stats, adapter figures} every REPORT_EVERY_S and gets the
served adapters back (so it can drop those unloaded); reports older than `report_ttl_s` are
dropped (a replica that died stops reporting).
"""

from __future__ import annotations

import time

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError
from ort_lora.adapters.registry import check_name
from ort_lora.lora_request import LoRARequest

REPORT_EVERY_S = 1.0


class AdapterDirectory:
    def __init__(self, static: list[tuple[str, str]] = (), report_ttl_s: float = 10.0):
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._reports: dict[str, tuple[float, dict]] = {}
        self.report_ttl_s = report_ttl_s
        self.version = 0
        for name, path in static:
            self.add(name, path)

    def add(self, name: str, path: str) -> tuple[LoRARequest, int]:
        """Record an adapter (its path already resolved and its files checked by the caller):
        (it, the new version); AdapterError if the name is invalid or taken."""
        check_name(name)
        if name in self._adapters:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, self._next_id, str(path))
        self._next_id += 1
        self._adapters[name] = lora
        self.version += 1
        return lora, self.version

    def remove(self, name: str) -> int:
        """Forget an adapter (no replica serves it after its next report); the new version."""
        if name not in self._adapters:
            raise AdapterNotFoundError(f"adapter not found: {name!r}")
        del self._adapters[name]
        self.version += 1
        return self.version

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def report(self, replica: str, figures: dict) -> dict[str, int]:
        """A replica's figures; returns the adapters served (name -> int id)."""
        self._reports[replica] = (time.monotonic(), figures)
        return {name: lora.lora_int_id for name, lora in self._adapters.items()}

    def snapshot(self) -> tuple[int, list[LoRARequest], dict[str, dict]]:
        """The version, the adapters, and the latest figures of every replica that reported
        lately."""
        now = time.monotonic()
        stale = [r for r, (t, _) in self._reports.items() if now - t > self.report_ttl_s]
        for replica in stale:
            del self._reports[replica]
        reports = {r: figures for r, (_, figures) in self._reports.items()}
        return self.version, self.adapters(), reports
