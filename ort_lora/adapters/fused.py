"""LoRA on fused checkpoint modules (Phi-3's qkv_proj, gate_up_proj), mapped onto the graph's
separate target modules (contract.py, "Fused checkpoint modules").

A fused module f with parts p_1..p_n (manifest.fused_modules[f], in row order) computes
y = W x with W the parts' weights stacked by rows; PEFT's LoRA on it adds scale * B A x with
A [r, in] and B [sum of outs, r]. Row block i of that delta is scale * B_i A x, where B_i is
B's rows of part i: so the adapter is served as LoRA (A, B_i) on each part p_i, with the fused
module's rank and scaling. Exact, and the graph, the pool layout and the kernels are those of
unfused models (A is stored and applied once per part: n - 1 extra rank-r products per token).
DoRA is row-wise too: the magnitude m [sum of outs] and the norm of each row of W + s B A split
by the same row blocks, so part i keeps its rows of m and its own rows' norms.
"""

from __future__ import annotations

from ort_lora.adapters.errors import AdapterError
from ort_lora.contract import ModelManifest


def module_parts(manifest: ModelManifest, module: str) -> list[str]:
    """The target modules a tensor of `module` lands on: its parts if the export has it as a
    fused module, else [module]."""
    return list(manifest.fused_modules.get(module, [module]))


def module_dims(manifest: ModelManifest, module: str) -> dict[str, int]:
    """{"in", "out"} of `module` as the adapter sees it (a fused module: its parts' rows
    together); every part must be an exported LoRA target."""
    parts = [manifest.lora_targets[p] for p in module_parts(manifest, module)]
    return {"in": parts[0]["in"], "out": sum(p["out"] for p in parts)}


def split_fused(pairs: dict, manifest: ModelManifest) -> dict:
    """{(module, layer): (key, A [r, in], B [out, r], DoRA magnitude [out] or None)} with every
    fused module's entry replaced by one entry per part: the same A, B's rows of that part (and
    the magnitude's), the fused module's key (so its rank and scaling apply)."""
    out = {}
    for (module, layer), (key, a, b, m) in pairs.items():
        start = 0
        for part in module_parts(manifest, module):
            if (part, layer) in out:
                raise AdapterError(
                    f"{key!r} and {out[(part, layer)][0]!r} both put LoRA on {part} of layer "
                    f"{layer}; expected one of them"
                )
            rows = slice(start, start + manifest.lora_targets[part]["out"])
            out[(part, layer)] = (key, a, b[rows], None if m is None else m[rows])
            start = rows.stop
    return out
