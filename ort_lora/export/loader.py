"""Checkpoint readers: a local Hugging Face directory (safetensors, sharded or not) or a GGUF
file (through transformers' GGUF support, dequantized). Never touches the network.

Both expose the same small interface, `CheckpointSource`: the config dict, the generation
config dict, and tensors fetched one at a time by their Hugging Face name, so the exporter can
convert and write each tensor before reading the next.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from ort_lora.export.arch import arch_config
from ort_lora.export.errors import ExportError


class CheckpointSource:
    """Tensors and configs of one checkpoint, read lazily by Hugging Face tensor name."""

    config: dict
    generation_config: dict
    path: Path

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str):
        """The tensor `name` as a torch.Tensor in its stored dtype."""
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()


class SafetensorsDirSource(CheckpointSource):
    """A local Hugging Face checkpoint directory: config.json + *.safetensors."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.config = _read_json(path / "config.json")
        arch_config(self.config)  # fail on an unsupported model before reading weights
        gen = path / "generation_config.json"
        self.generation_config = _read_json(gen) if gen.is_file() else {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in path.glob("*.bin")) + sorted(
                p.name for p in path.glob("*.pt")
            )
            hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
            raise ExportError(f"no weights: {path} has no *.safetensors files{hint}")
        self._handles = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:  # a truncated or foreign file
                raise ExportError(f"cannot read weights file {f}: {e}") from None
            self._handles[f] = handle
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                self._where[name] = f

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str):
        if name not in self._where:
            raise ExportError(f"checkpoint {self.path} lacks the tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)


class GGUFSource(CheckpointSource):
    """A .gguf file, dequantized to float32 by transformers (needs the `gguf` package)."""

    def __init__(self, path: Path):
        require_gguf()
        import torch
        from transformers import AutoModelForCausalLM

        self.path = path
        _check_ggml_types(path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        except Exception as e:
            raise ExportError(f"cannot load GGUF file {path}: {e}") from None
        self.config = model.config.to_dict()
        self.generation_config = model.generation_config.to_dict()
        self._tensors = dict(model.state_dict())
        self._model, self._stored = model, None

    def gguf_tensors(self):
        """The file's tensors as stored (GGML blocks), for quantized exports (gguf_blocks.py)."""
        if self._stored is None:
            from ort_lora.export.gguf_blocks import GGUFTensors

            self._stored = GGUFTensors(self.path, self._model)
        return self._stored

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str):
        if name not in self._tensors:
            raise ExportError(f"GGUF model {self.path} lacks the tensor {name!r}")
        return self._tensors[name]


def _check_ggml_types(path: Path) -> None:
    """An ExportError naming the first tensor whose GGML type neither the gguf package can
    dequantize nor ort-lora can carry over (checked before transformers reads the weights)."""
    from gguf import GGUFReader

    from ort_lora.export.gguf_blocks import dequantizable

    try:
        tensors = GGUFReader(str(path)).tensors
    except Exception as e:
        raise ExportError(f"cannot read GGUF file {path}: {e}") from None
    known: dict = {}
    for t in tensors:
        if t.tensor_type not in known:
            known[t.tensor_type] = dequantizable(t.tensor_type)
        if not known[t.tensor_type]:
            raise ExportError(
                f"GGUF tensor {t.name} of {path.name} has type {t.tensor_type.name}, which "
                "ort-lora can neither map onto MatMulNBits blocks (Q4_0, Q4_1, Q8_0) nor "
                "dequantize (the gguf package has no dequantizer for it)"
            )


def require_gguf() -> None:
    """Raise an ExportError unless the `gguf` package can be imported."""
    try:
        importlib.import_module("gguf")
    except ImportError:
        raise ExportError(
            "reading GGUF files needs the `gguf` package: pip install 'gguf>=0.10'"
        ) from None


def open_checkpoint(model_path: str | Path) -> CheckpointSource:
    """A CheckpointSource for a checkpoint directory or a .gguf file, or an ExportError."""
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ExportError(
            f"model path {path} does not exist (expected a checkpoint directory "
            "with config.json and *.safetensors, or a .gguf file)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(
                f"{path} is a file but not a .gguf file; pass a checkpoint "
                "directory or a .gguf file"
            )
        return GGUFSource(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFSource(ggufs[0])
        raise ExportError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return SafetensorsDirSource(path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"cannot read {path}: {e}") from None
