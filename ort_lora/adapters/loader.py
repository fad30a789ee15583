"""AdapterLoader: read, check and convert an adapter's files into its host form. It changes
nothing but its load counter, so any thread may call it (the server reads adapters off the
engine's thread), and a front end can check an adapter's files without a registry.

DoRA adapters get their scale rows here (adapters/dora.py), from the base weights of the
export the manifest was loaded from (adapters/base_weights.py) or those given."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ort_lora.adapter_rows import AUTO
from ort_lora.adapters.base_weights import BaseWeights, ExportedWeights
from ort_lora.adapters.bounds import storage_type
from ort_lora.adapters.dora import dora_scale_rows
from ort_lora.adapters.errors import AdapterError
from ort_lora.adapters.host import WEIGHTS_NAME, HostAdapter, load_adapter
from ort_lora.adapters.layout import pool_row_type, prepare_rows
from ort_lora.adapters.names import check_name, resolve_adapter_dir, unresolvable
from ort_lora.adapters.peft_config import CONFIG_NAME
from ort_lora.contract import ModelManifest
from ort_lora.lora_request import LoRARequest


class AdapterLoader:
    """Adapters of one manifest, read from under adapter_root (None: anywhere).
    base_weights: where DoRA adapters' base weights come from; None: the export the manifest
    was loaded from (manifest.model_dir), read back by memory map on the first DoRA adapter."""

    def __init__(
        self,
        manifest: ModelManifest,
        adapter_root: str | Path | None = None,
        base_weights: BaseWeights | None = None,
    ):
        self.manifest = manifest
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.base_weights = base_weights
        if base_weights is None and manifest.model_dir is not None:
            self.base_weights = ExportedWeights(manifest.model_dir)  # indexed on first use
        self.loads = 0  # adapters read and converted

    def load(
        self, request: LoRARequest, dora_rows: dict[str, np.ndarray] | None = None
    ) -> HostAdapter:
        """Read, check and convert the adapter's files (AdapterError names the problem).
        dora_rows: a DoRA adapter's D per module, computed before from these same files (else
        computed now)."""
        check_name(request.lora_name)
        path = self.check_path(request.lora_path)
        try:
            adapter = load_adapter(request.lora_name, path, self.manifest)
        except OSError as e:  # unreadable, a directory where a file should be, too long
            raise AdapterError(
                f"adapter {request.lora_name!r}: cannot read its files: {unresolvable(e)}"
            ) from None
        dora_modules = {m for m, w in adapter.modules.items() if w.magnitude is not None}
        if adapter.is_dora and dora_rows is not None and set(dora_rows) == dora_modules:
            for m, d in dora_rows.items():
                adapter.modules[m].dora, adapter.modules[m].magnitude = d, None
        elif adapter.is_dora:
            self._dora_rows(adapter)
        prepare_rows(adapter, pool_row_type(adapter, self.manifest))
        self.loads += 1
        return adapter

    def check_path(self, path: str) -> Path:
        return resolve_adapter_dir(path, self.adapter_root)

    def stamp(self, request: LoRARequest) -> tuple:
        """(size, mtime) of the adapter's files: whether what was computed from them (DoRA
        rows, the content digest) may still be theirs; () if they cannot be read."""
        try:
            path = self.check_path(request.lora_path)
            stats = [(path / name).stat() for name in (CONFIG_NAME, WEIGHTS_NAME)]
        except (OSError, AdapterError):
            return ()
        return tuple((st.st_size, st.st_mtime_ns) for st in stats)

    def _dora_rows(self, adapter: HostAdapter) -> None:
        """Compute a DoRA adapter's scale rows; AdapterError when this export cannot serve it."""
        if "dora" not in self.manifest.lora_features:
            raise AdapterError(
                f"adapter {adapter.name!r} is a DoRA adapter (use_dora), but the exported model "
                "predates DoRA support (its manifest's lora_features lacks 'dora'): re-export it"
            )
        if self.base_weights is None:
            raise AdapterError(
                f"adapter {adapter.name!r} is a DoRA adapter (use_dora): its scale needs the "
                "base weights, and this registry has none (no model directory, no base_weights)"
            )
        fixed = self.manifest.adapter_dtype  # "auto": rows float32 unless exact as they are
        row_type = None if fixed == AUTO else fixed
        dora_scale_rows(adapter, self.base_weights, row_type, storage_type(self.manifest))
