"""ModuleWeights: one target module's LoRA weights over all layers, in host form (host.py's
module docstring gives the shapes). Its own file so that the checks on it (bounds.py) and
the loader that makes it (host.py) need not import each other."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ModuleWeights:
    """One target module's LoRA weights over all layers (see the module docstring)."""

    a: np.ndarray  # [num_layers, max_rank, in]
    bt: np.ndarray  # [num_layers, max_rank, out]
    ranks: np.ndarray  # int32 [num_layers]
    scales: np.ndarray  # float32 [num_layers]
    magnitude: np.ndarray | None = None  # DoRA's m [num_layers, out] until dora is computed
    dora: np.ndarray | None = None  # DoRA's D [num_layers, out]; None: not a DoRA module

    @property
    def max_rank(self) -> int:
        return self.a.shape[1]

    def layer_a(self, layer: int) -> np.ndarray:
        return self.a[layer, : self.ranks[layer]]  # [r_l, in]

    def layer_bt(self, layer: int) -> np.ndarray:
        return self.bt[layer, : self.ranks[layer]]  # [r_l, out]
