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

from ort_lora.adapters.bounds import check_module, scale_problem, storage_type
from ort_lora.adapters.errors import AdapterError
from ort_lora.adapters.fused import module_dims, module_parts, split_fused
from ort_lora.adapters.module_weights import ModuleWeights
from ort_lora.adapters.peft_config import CONFIG_NAME, PeftLoraConfig, read_config
from ort_lora.adapters.safetensors_io import SafetensorsFile
from ort_lora.contract import LORA_MODULES, ModelManifest

WEIGHTS_NAME = "adapter_model.safetensors"
KNOWN_MODULES = (*LORA_MODULES, "qkv_proj", "gate_up_proj")  # modules an error may name
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# base_model.model.<key>.lora_{A,B}[.<adapter name>].weight, and DoRA's
# base_model.model.<key>.lora_magnitude_vector[.<adapter name>][.weight]; key ends in
# layers.<l>.<block>.<m>. The file's names are its contents: errors describe a tensor by the
# module and layer it was checked to be for (`_describe`), never by the name in the file.
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<key>(?:.*\.)?layers\.(?P<layer>\d{1,6})\.[^.]+\.(?P<module>[^.]+))"
    r"\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight|lora_(?P<m>magnitude)_vector(?:\.[^.]+)??(?:\.weight)?)$"
)


@dataclass
class HostAdapter:
    """A converted adapter, ready to be laid out into pool pages."""

    name: str
    path: Path
    modules: dict[str, ModuleWeights] = field(default_factory=dict)
    base_model: str | None = None  # what its config names as its base model
    _packings: dict = field(default_factory=dict, repr=False, compare=False)  # layout.py's cache
    _pool_rows: dict = field(default_factory=dict, repr=False, compare=False)  # layout.py's too
    _row_type: dict = field(default_factory=dict, repr=False, compare=False)  # layout.py's too

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


def resolve_weights(adapter_dir: Path, where: str = "adapter") -> Path:
    """The adapter's safetensors file; refuses pickle-only adapters (never unpickled). where:
    what errors call the adapter (never its resolved path: the server's layout)."""
    if adapter_dir.is_file():
        if adapter_dir.suffix in PICKLE_SUFFIXES:
            raise AdapterError(
                f"{where}: pickle weight files are refused; safetensors only "
                f"(pass the adapter directory holding {WEIGHTS_NAME})"
            )
        raise AdapterError(f"{where}: expected an adapter directory, got a file")
    if not adapter_dir.is_dir():
        raise AdapterError(f"{where}: adapter directory does not exist")
    weights = adapter_dir / WEIGHTS_NAME
    if weights.is_file():
        return weights
    if any(p.suffix in PICKLE_SUFFIXES for p in adapter_dir.iterdir()):
        raise AdapterError(
            f"{where}: weights only as pickle files; safetensors only (re-save with "
            f"save_pretrained(safe_serialization=True) to get {WEIGHTS_NAME})"
        )
    raise AdapterError(f"{where}: no {WEIGHTS_NAME}")


def load_adapter(name: str, adapter_dir: str | Path, manifest: ModelManifest) -> HostAdapter:
    """Read, validate and convert a PEFT LoRA adapter directory; AdapterError on any problem,
    naming the adapter, its file (by its name in the directory) and the rule broken, never
    the directory's resolved path nor the file's bytes or tensor names."""
    adapter_dir = Path(adapter_dir)
    label = f"adapter {name!r}"
    weights = resolve_weights(adapter_dir, label)
    config = read_config(adapter_dir, f"{label}: {CONFIG_NAME}")
    where = f"{label}: {WEIGHTS_NAME}"
    with SafetensorsFile(weights, where) as f:  # names and shapes checked before any data
        pairs = _pair_tensors(f.tensors, config, manifest, where)
        if not pairs:
            raise AdapterError(f"{where}: no LoRA tensors (expected names like {_example()})")
        views = {
            k: (key, f.view(a), f.view(b), None if m is None else f.view(m))
            for k, (key, a, b, m) in pairs.items()
        }
        modules = _stack_modules(views, config, manifest, where)  # the one copy out of the map
        del views
        if not all(_finite(w) for w in modules.values()):
            f.check_finite(_descriptions(pairs))  # names the tensor (by module and layer)
            raise AdapterError(f"{where}: holds NaN or inf values")
    for module, w in modules.items():
        check_module(where, module, w, storage_type(manifest))
    return HostAdapter(name, adapter_dir, modules, config.base_model)


_SUFFIX = {"A": "lora_A.weight", "B": "lora_B.weight", "M": "lora_magnitude_vector"}


def _describe(module: str, layer: int, kind: str) -> str:
    """A tensor, by the module and layer its name was checked to be for (not its name)."""
    return f"'layers.{layer}.{module}.{_SUFFIX[kind]}'"


def _descriptions(pairs: dict) -> dict[str, str]:
    """{tensor name in the file: its description} of every paired tensor."""
    out = {}
    for (module, layer), (_, a, b, m) in pairs.items():
        out |= {a: _describe(module, layer, "A"), b: _describe(module, layer, "B")}
        if m is not None:
            out[m] = _describe(module, layer, "M")
    return out


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
    for i, (tname, t) in enumerate(tensors.items()):
        m = _TENSOR_RE.match(tname)
        if m is None:
            raise AdapterError(
                f"{where}: tensor #{i} of the header is not named as a LoRA A/B weight of a "
                f"layer nor as a DoRA magnitude (expected names like {_example()})"
            )
        module, layer = m.group("module"), int(m.group("layer"))
        _check_target(i, m.group("key"), module, layer, config, manifest, where)
        parts.setdefault((module, layer), {})[m.group("ab") or "M"] = (tname, t)
    pairs = {}
    for (module, layer), ab in parts.items():
        _check_complete(ab, module, layer, config.use_dora, where)
        key = _TENSOR_RE.match(ab["A"][0]).group("key")
        _check_shapes(ab, module, layer, config.rank(key), manifest, where)
        pairs[(module, layer)] = (key, ab["A"][0], ab["B"][0], ab.get("M", (None,))[0])
    return pairs


def _check_complete(ab: dict, module: str, layer: int, use_dora: bool, where: str) -> None:
    """A and B, and a DoRA magnitude exactly when adapter_config.json says use_dora."""
    name = _describe(module, layer, next(iter(ab)))
    for half in ("A", "B"):
        if half not in ab:
            raise AdapterError(f"{where}: tensor {name} has no matching lora_{half} tensor")
    if use_dora and "M" not in ab:
        raise AdapterError(
            f"{where}: tensor {_describe(module, layer, 'A')} has no matching "
            "lora_magnitude_vector tensor (adapter_config.json says use_dora: true)"
        )
    if not use_dora and "M" in ab:
        raise AdapterError(
            f"{where}: tensor {_describe(module, layer, 'M')} is a DoRA magnitude, but "
            "adapter_config.json says use_dora: false"
        )


def _check_target(index, key, module, layer, config, manifest, where) -> None:
    """index: the tensor's place in the header (its name is not shown: file contents)."""
    parts = module_parts(manifest, module)  # [module], or a fused module's parts (Phi-3)
    supported = list(LORA_MODULES) + list(manifest.fused_modules)
    if any(p not in LORA_MODULES for p in parts):
        known = module in KNOWN_MODULES  # a name we know is not file contents
        raise AdapterError(
            f"{where}: tensor #{index} of the header targets "
            f"{f'module {module!r}' if known else 'a module'}; supported LoRA modules are "
            f"{supported}"
        )
    if any(p not in manifest.lora_targets for p in parts):
        missing = ", ".join(repr(p) for p in parts if p not in manifest.lora_targets)
        raise AdapterError(
            f"{where}: a tensor for {module!r} targets {missing}, which the exported model does "
            f"not target (exported LoRA targets: {sorted(manifest.lora_targets)}); re-export "
            "with it"
        )
    if not 0 <= layer < manifest.num_layers:
        raise AdapterError(
            f"{where}: a tensor for {module} is for layer {layer}; "
            f"the model has layers 0..{manifest.num_layers - 1}"
        )
    if not config.targets(key):
        raise AdapterError(
            f"{where}: a tensor is for {module} of layer {layer}, which adapter_config.json "
            f"(target_modules / layers_to_transform / exclude_modules) does not select"
        )


def _check_shapes(ab, module, layer, rank, manifest: ModelManifest, where) -> None:
    dims = module_dims(manifest, module)
    a, b = ab["A"][1], ab["B"][1]
    if "M" in ab and tuple(ab["M"][1].shape) != (dims["out"],):
        raise AdapterError(
            f"{where}: tensor {_describe(module, layer, 'M')} has shape "
            f"{list(ab['M'][1].shape)}; expected [out={dims['out']}] (a DoRA magnitude per "
            "output row of the module)"
        )
    if tuple(a.shape) != (rank, dims["in"]):
        raise AdapterError(
            f"{where}: tensor {_describe(module, layer, 'A')} has shape {list(a.shape)}; "
            f"expected [r={rank}, in={dims['in']}] (rank from adapter_config.json, in from the "
            "model)"
        )
    if tuple(b.shape) != (dims["out"], rank):
        raise AdapterError(
            f"{where}: tensor {_describe(module, layer, 'B')} has shape {list(b.shape)}; "
            f"expected [out={dims['out']}, r={rank}] (rank from adapter_config.json, out from "
            "the model)"
        )


def _checked_scaling(config: PeftLoraConfig, key: str, module: str, layer: int, where) -> float:
    """PEFT's scaling of the module: AdapterError naming the fields it comes from when it is
    out of range (bounds.scale_problem: LoraSGMV multiplies it in float32)."""
    scale = config.scaling(key)
    problem = scale_problem(scale)
    if problem is not None:
        raise AdapterError(
            f"{where}: {module} of layer {layer}: scaling {config.scaling_rule(key)} = "
            f"{scale:.4g} {problem}"
        )
    return scale


def _stack_modules(pairs: dict, config: PeftLoraConfig, manifest: ModelManifest, where) -> dict:
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
            w.scales[layer] = _checked_scaling(config, key, module, layer, where)
            if m is not None:
                w.magnitude[layer] = m
        modules[module] = w
    return modules
