"""Load a PEFT adapter directory into its host form, validated against the model manifest.

Host form (float32, per target module m of the adapter):
  a      [num_layers, max_rank_m, in_m]   A rows; rows >= rank of a layer are zero
  bt     [num_layers, max_rank_m, out_m]  B^T rows (PEFT stores B as [out, r])
  ranks  int32 [num_layers]               0 where the layer has no LoRA on m
  scales float32 [num_layers]             PEFT's scaling of that layer's module
DoRA adapters (use_dora) also have, per module, PEFT's lora_magnitude_vector:
  magnitude [num_layers, out_m]           m as loaded (0 where the layer has no LoRA on m)
  dora      [num_layers, out_m]           D = m / ||W + s B A||_row - 1, set from the base
                                          weights by adapters/dora.py (which drops magnitude)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ort_lora.adapters.errors import AdapterError
from ort_lora.adapters.fused import module_dims, module_parts, split_fused
from ort_lora.adapters.peft_config import PeftLoraConfig, read_config
from ort_lora.adapters.safetensors_io import SafetensorsFile
from ort_lora.contract import LORA_MODULES, ModelManifest

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# base_model.model.<key>.lora_{A,B}[.<adapter name>].weight, and DoRA's
# base_model.model.<key>.lora_magnitude_vector[.<adapter name>][.weight]; key ends in
# layers.<l>.<block>.<m>
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<key>(?:.*\.)?layers\.(?P<layer>\d+)\.[^.]+\.(?P<module>[^.]+))"
    r"\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|lora_(?P<m>magnitude)_vector(?:\.[^.]+)??(?:\.weight)?)$"
)


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


@dataclass
class HostAdapter:
    """A converted adapter, ready to be laid out into pool pages."""

    name: str
    path: Path
    modules: dict[str, ModuleWeights] = field(default_factory=dict)
    _packings: dict = field(default_factory=dict, repr=False, compare=False)  # layout.py's cache
    _pool_rows: dict = field(default_factory=dict, repr=False, compare=False)  # layout.py's too

    @property
    def nbytes(self) -> int:
        return sum(
            w.a.nbytes + w.bt.nbytes + (0 if w.dora is None else w.dora.nbytes)
            for w in self.modules.values()
        )

    @property
    def is_dora(self) -> bool:
        """Whether any module has DoRA rows (PEFT use_dora)."""
        return any(w.dora is not None or w.magnitude is not None for w in self.modules.values())


def resolve_weights(adapter_dir: Path) -> Path:
    """The adapter's safetensors file; refuses pickle-only adapters (never unpickled)."""
    if adapter_dir.is_file():
        if adapter_dir.suffix in PICKLE_SUFFIXES:
            raise AdapterError(
                f"{adapter_dir}: pickle weight files are refused; safetensors only "
                f"(pass the adapter directory holding {WEIGHTS_NAME})"
            )
        raise AdapterError(f"{adapter_dir}: expected an adapter directory, got a file")
    if not adapter_dir.is_dir():
        raise AdapterError(f"{adapter_dir}: adapter directory does not exist")
    weights = adapter_dir / WEIGHTS_NAME
    if weights.is_file():
        return weights
    pickles = sorted(p.name for p in adapter_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterError(
            f"{adapter_dir}: weights only as pickle files {pickles}; safetensors only "
            f"(re-save with save_pretrained(safe_serialization=True) to get {WEIGHTS_NAME})"
        )
    raise AdapterError(f"{adapter_dir}: no {WEIGHTS_NAME}")


def load_adapter(name: str, adapter_dir: str | Path, manifest: ModelManifest) -> HostAdapter:
    """Read, validate and convert a PEFT LoRA adapter directory; AdapterError on any problem."""
    adapter_dir = Path(adapter_dir)
    weights = resolve_weights(adapter_dir)
    config = read_config(adapter_dir)
    with SafetensorsFile(weights) as f:  # names and shapes checked before any data is read
        pairs = _pair_tensors(f.tensors, config, manifest, weights)
        if not pairs:
            raise AdapterError(f"{weights}: no LoRA tensors (expected names like {_example()})")
        views = {
            k: (key, f.view(a), f.view(b), None if m is None else f.view(m))
            for k, (key, a, b, m) in pairs.items()
        }
        modules = _stack_modules(views, config, manifest)  # the one copy out of the map
        del views
        if not all(_finite(w) for w in modules.values()):
            f.check_finite(f.tensors)  # names the tensor
            raise AdapterError(f"{weights}: holds NaN or inf values")
    return HostAdapter(name, adapter_dir, modules)


def _finite(w: ModuleWeights) -> bool:
    arrays = (w.a, w.bt) if w.magnitude is None else (w.a, w.bt, w.magnitude)
    return all(np.isfinite(x).all() for x in arrays)


def _example() -> str:
    return "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _pair_tensors(tensors, config: PeftLoraConfig, manifest: ModelManifest, where: Path) -> dict:
    """{(module, layer): (key, A's name, B's name, DoRA magnitude's name or None)}, every
    tensor's name and shape checked. tensors: name -> anything with a `.shape` (the file's
    header entries)."""
    parts: dict[tuple[str, int], dict[str, tuple[str, np.ndarray]]] = {}
    for tname, t in tensors.items():
        m = _TENSOR_RE.match(tname)
        if m is None:
            raise AdapterError(
                f"{where}: tensor {tname!r} is not a LoRA A/B weight of a layer "
                "(nor a DoRA magnitude)"
            )
        module, layer = m.group("module"), int(m.group("layer"))
        _check_target(tname, m.group("key"), module, layer, config, manifest, where)
        parts.setdefault((module, layer), {})[m.group("ab") or "M"] = (tname, t)
    pairs = {}
    for (module, layer), ab in parts.items():
        _check_complete(ab, config.use_dora, where)
        key = _TENSOR_RE.match(ab["A"][0]).group("key")
        _check_shapes(ab, module, config.rank(key), manifest, where)
        pairs[(module, layer)] = (key, ab["A"][0], ab["B"][0], ab.get("M", (None,))[0])
    return pairs


def _check_complete(ab: dict, use_dora: bool, where: Path) -> None:
    """A and B, and a DoRA magnitude exactly when adapter_config.json says use_dora."""
    name = next(iter(ab.values()))[0]
    for half in ("A", "B"):
        if half not in ab:
            raise AdapterError(f"{where}: tensor {name!r} has no matching lora_{half} tensor")
    if use_dora and "M" not in ab:
        raise AdapterError(
            f"{where}: tensor {ab['A'][0]!r} has no matching lora_magnitude_vector tensor "
            "(adapter_config.json says use_dora: true)"
        )
    if not use_dora and "M" in ab:
        raise AdapterError(
            f"{where}: tensor {ab['M'][0]!r} is a DoRA magnitude, but adapter_config.json says "
            "use_dora: false"
        )


def _check_target(tname, key, module, layer, config, manifest, where) -> None:
    parts = module_parts(manifest, module)  # [module], or a fused module's parts (Phi-3)
    if any(p not in LORA_MODULES for p in parts):
        raise AdapterError(
            f"{where}: tensor {tname!r} targets module {module!r}; supported LoRA modules are "
            f"{list(LORA_MODULES) + list(manifest.fused_modules)}"
        )
    if any(p not in manifest.lora_targets for p in parts):
        missing = ", ".join(repr(p) for p in parts if p not in manifest.lora_targets)
        raise AdapterError(
            f"{where}: tensor {tname!r} targets {missing}, which the exported model does not "
            f"target (exported LoRA targets: {sorted(manifest.lora_targets)}); re-export with it"
        )
    if not 0 <= layer < manifest.num_layers:
        raise AdapterError(
            f"{where}: tensor {tname!r} is for layer {layer}; "
            f"the model has layers 0..{manifest.num_layers - 1}"
        )
    if not config.targets(key):
        raise AdapterError(
            f"{where}: tensor {tname!r} is for module {key!r}, which adapter_config.json "
            f"(target_modules / layers_to_transform / exclude_modules) does not select"
        )


def _check_shapes(ab, module, rank, manifest: ModelManifest, where) -> None:
    dims = module_dims(manifest, module)
    (a_name, a), (b_name, b) = ab["A"], ab["B"]
    if "M" in ab and tuple(ab["M"][1].shape) != (dims["out"],):
        raise AdapterError(
            f"{where}: tensor {ab['M'][0]!r} has shape {list(ab['M'][1].shape)}; expected "
            f"[out={dims['out']}] (a DoRA magnitude per output row of the module)"
        )
    if tuple(a.shape) != (rank, dims["in"]):
        raise AdapterError(
            f"{where}: tensor {a_name!r} has shape {list(a.shape)}; expected "
            f"[r={rank}, in={dims['in']}] (rank from adapter_config.json, in from the model)"
        )
    if tuple(b.shape) != (dims["out"], rank):
        raise AdapterError(
            f"{where}: tensor {b_name!r} has shape {list(b.shape)}; expected "
            f"[out={dims['out']}, r={rank}] (rank from adapter_config.json, out from the model)"
        )


def _stack_modules(pairs: dict, config: PeftLoraConfig, manifest: ModelManifest) -> dict:
    pairs = split_fused(pairs, manifest)  # LoRA on fused modules onto their parts
    modules = {}
    num_layers = manifest.num_layers
    for module in LORA_MODULES:
        layers = {layer: v for (m, layer), v in pairs.items() if m == module}
        if not layers:
            continue
        dims = manifest.lora_targets[module]
        max_rank = max(a.shape[0] for _, a, _, _ in layers.values())
        w = ModuleWeights(
            a=np.zeros((num_layers, max_rank, dims["in"]), np.float32),
            bt=np.zeros((num_layers, max_rank, dims["out"]), np.float32),
            ranks=np.zeros(num_layers, np.int32),
            scales=np.zeros(num_layers, np.float32),
        )
        if config.use_dora:
            w.magnitude = np.zeros((num_layers, dims["out"]), np.float32)
        for layer, (key, a, b, m) in layers.items():
            r = a.shape[0]
            w.a[layer, :r] = a
            w.bt[layer, :r] = b.T
            w.ranks[layer] = r
            w.scales[layer] = config.scaling(key)
            if m is not None:
                w.magnitude[layer] = m
        modules[module] = w
    return modules
