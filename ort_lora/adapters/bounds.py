"""Numeric bounds of an adapter, checked once when it is loaded: every number LoraSGMV
multiplies stays finite in float32, the kernel's arithmetic, and in the type the rows are
stored in (manifest dtype, or adapter_dtype "bfloat16", "float16" or "int8" in a float32 pool).

LoraSGMV computes, per module, layer and term (adapter of scale s = lora_alpha / r, composed
at weight w; w = 1 alone) on a token's x [in]:
    v = (w * s) * (A x)          [r]    shrink (int8 rows fold their row scales into w * s)
    y += B v                     [out]  expand
    y *= 1 + D                          DoRA only (one term): D = m / ||W + s B A||_row - 1
With ||A||_F the Frobenius norm of A [r, in] and ||B_i|| the norm of row i of B [out, r]:
    |v_k|     <= |w| * |s| * ||A||_F * ||x||                       (shrink gain |s| ||A||_F)
    |(B v)_i| <= |w| * |s| * ||A||_F * max_i ||B_i|| * ||x||       (delta gain), partial sums too
and every entry of s B A is at most the delta gain. An adapter is refused (AdapterError naming
the module, the layer and the rule) when a stored value is not finite in its storage type,
|s| > MAX_SCALE, or a gain exceeds MAX_GAIN (capped at the storage type's largest value, so s
B A fits a float16 pool too). With |w| <= lora_request.MAX_WEIGHT (1e3), a term then adds at
most 1e9 * ||x|| to an output: float32 (3.4e38) cannot overflow for any activation a model that
works has (||x|| < 1e25 even with 64 adapters composed). Gains are computed in float64 from the
float32 rows; bfloat16, float16 and int8 rounding change them by under 1%.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ort_lora.adapter_rows import AUTO
from ort_lora.adapters.errors import AdapterError

if TYPE_CHECKING:
    from ort_lora.adapters.module_weights import ModuleWeights
    from ort_lora.contract import ModelManifest

# |s| = |lora_alpha / r| (rsLoRA: / sqrt(r)): PEFT's scalings are 0.1..a few hundred in practice
MAX_SCALE = 1e5
# |s| ||A||_F and |s| ||A||_F max_i ||B_i||: trained adapters have well under 1e4
MAX_GAIN = 1e6
_SHRINK, _DELTA = "|scaling| * ||A||", "|scaling| * ||A|| * max ||B row||"
_LARGEST = {  # the largest finite value of each storage type
    "float32": float(np.finfo(np.float32).max),
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": float(np.float32(np.uint32(0x7F7F0000).view(np.float32))),  # 3.3895e38
    "int8": float(np.finfo(np.float32).max),  # a float32 row scale times int8 values
}


def storage_type(manifest: ModelManifest) -> str:
    """How the adapter rows of this export are stored: float32, float16, bfloat16 or int8
    (adapter_dtype "auto": float32, narrower only where that holds an adapter exactly)."""
    if manifest.adapter_dtype == AUTO:
        return "float32"
    return manifest.adapter_dtype or manifest.dtype


def scale_problem(scale: float) -> str | None:
    """Why a module's scaling cannot be served (None: it can)."""
    if not np.isfinite(scale) or abs(scale) > MAX_SCALE:
        return f"is out of range: |scaling| <= {MAX_SCALE:g}"
    return None


def check_module(where: str, module: str, w: ModuleWeights, storage: str) -> None:
    """AdapterError naming the module and layer whose values or gains are out of bounds (see
    the module docstring). w: float32 rows, finite (checked before)."""
    largest = _LARGEST[storage]
    cap = min(MAX_GAIN, largest)
    peaks = np.maximum(_peak(w.a), _peak(w.bt))  # [L]
    a_norm = np.sqrt(np.einsum("lri,lri->l", w.a, w.a, dtype=np.float64))  # [L]
    b_rows = np.sqrt(np.einsum("lro,lro->lo", w.bt, w.bt, dtype=np.float64)).max(axis=1)  # [L]
    scales = np.abs(w.scales.astype(np.float64))
    for layer in np.flatnonzero(w.ranks):
        at = f"{where}: {module} of layer {layer}"
        if peaks[layer] > largest:
            raise AdapterError(
                f"{at}: a LoRA weight of magnitude {peaks[layer]:.3g} does not fit the "
                f"{storage} rows of this export (largest {largest:.5g})"
            )
        shrink = scales[layer] * a_norm[layer]
        delta = shrink * b_rows[layer]
        for what, gain in ((_SHRINK, shrink), (_DELTA, delta)):
            if gain > cap:
                raise AdapterError(
                    f"{at}: {what} = {gain:.3g} is out of range: the scaled LoRA product could "
                    f"overflow (at most {cap:g} per unit of input norm)"
                )


def check_dora(where: str, module: str, layer: int, g: np.ndarray, storage: str) -> None:
    """AdapterError unless every DoRA factor g = m / ||W + s B A||_row (float64 [out]) is finite
    and |g| <= MAX_GAIN (capped at the storage type's largest value): y is scaled by it."""
    cap = min(MAX_GAIN, _LARGEST[storage] - 1)  # D = g - 1 is what is stored
    bad = np.flatnonzero(~(np.abs(g) <= cap))  # NaN too
    if len(bad):
        raise AdapterError(
            f"{where}: {module} of layer {layer}, output row {bad[0]}: the DoRA factor "
            f"magnitude / weight norm = {g[bad[0]]:.3g} is not finite or out of range "
            f"(|factor| <= {cap:g})"
        )


def _peak(x: np.ndarray) -> np.ndarray:
    """max |x| per layer of x [L, R, n] (no |x| temporary), float64 [L]."""
    if x.size == 0:
        return np.zeros(x.shape[0])
    flat = x.reshape(x.shape[0], -1)
    return np.maximum(flat.max(axis=1), -flat.min(axis=1)).astype(np.float64)
