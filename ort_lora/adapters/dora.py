"""DoRA (PEFT use_dora): the per-output-channel scale of each module and layer, computed once
when the adapter is loaded.

PEFT's DoRA linear (peft/tuners/lora/dora.py, DoraLinearLayer.forward, eval mode) outputs
    base(x) + (g - 1) * (W x) + g * s * B A x  =  g * (W x + s B A x) + bias
with g = m / ||W + s B A||_row: m the adapter's lora_magnitude_vector [out], the norm of each
output row of the merged weight, detached (a constant at inference, as the DoRA paper asks).
W is the base layer's weight (dequantized when the base is quantized). So g is fixed once the
adapter is loaded: this module computes D = g - 1 per module and layer, the row LoraSGMV reads
(contract.py, "Composition and DoRA"): y_out = (W x + s B A x) * (1 + D), the bias added after.

The norm is computed in float64 from the exported base weights (adapters/base_weights.py), a
block of output rows at a time: W rows + s * B rows @ A, never a whole [out, in] product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ort_lora.adapter_rows import served
from ort_lora.adapters.bounds import check_dora
from ort_lora.adapters.errors import AdapterError

if TYPE_CHECKING:
    from ort_lora.adapters.base_weights import BaseWeights
    from ort_lora.adapters.host import HostAdapter

ROW_BLOCK = 256  # output rows per block of the norm (a block is ROW_BLOCK x in float64)


def weight_norm(rows, a: np.ndarray, bt: np.ndarray, scale: float) -> np.ndarray:
    """||W + scale * B @ A|| of every output row: float64 [out].

    rows(start, stop): W's rows [start, stop) [n, in]; a: A [r, in]; bt: B^T [r, out]."""
    a64, out = a.astype(np.float64), bt.shape[1]
    norms = np.empty(out, np.float64)
    for start in range(0, out, ROW_BLOCK):
        stop = min(out, start + ROW_BLOCK)
        merged = rows(start, stop) + scale * (bt[:, start:stop].T.astype(np.float64) @ a64)
        norms[start:stop] = np.sqrt(np.einsum("ij,ij->i", merged, merged))  # [n]
    return norms


def dora_scale_rows(
    adapter: HostAdapter,
    base: BaseWeights,
    row_type: str | None = None,
    storage: str = "float32",
) -> None:
    """Set every DoRA module's `dora` rows: D = m / ||W + s B A||_row - 1, float32
    [num_layers, out], 0 in layers without LoRA on the module; the magnitudes are dropped.
    row_type: A and B are served as rows of this type (manifest adapter_dtype: bfloat16 or
    int8 rounding, adapter_rows.served), so the norm is that of the rows served. AdapterError
    names the module and layer whose base weight cannot be read or whose scale is not finite
    (a zero norm, a magnitude not finite) or out of range (bounds.check_dora; storage: the
    type the rows are stored in, bounds.storage_type)."""
    for module, w in adapter.modules.items():
        if w.magnitude is None:
            continue
        d = np.zeros(w.magnitude.shape, np.float32)  # [L, out]
        for layer in np.flatnonzero(w.ranks):
            layer = int(layer)

            def rows(start: int, stop: int, layer=layer, module=module) -> np.ndarray:
                return base.rows(layer, module, start, stop)

            try:
                a = served(w.layer_a(layer), row_type)
                bt = served(w.layer_bt(layer), row_type)
                norm = weight_norm(rows, a, bt, w.scales[layer])
            except AdapterError as e:
                raise AdapterError(f"DoRA adapter {adapter.name!r}: {e}") from None
            with np.errstate(divide="ignore", invalid="ignore"):
                g = w.magnitude[layer].astype(np.float64) / norm  # [out]
            bad = np.flatnonzero(~np.isfinite(g))
            if len(bad):
                raise AdapterError(
                    f"DoRA adapter {adapter.name!r}: {module} of layer {layer}, output row "
                    f"{bad[0]}: magnitude {w.magnitude[layer, bad[0]]} / weight norm "
                    f"{norm[bad[0]]} is not finite"
                )
            check_dora(f"DoRA adapter {adapter.name!r}", module, layer, g, storage)
            d[layer] = g - 1.0
        w.dora, w.magnitude = d, None
