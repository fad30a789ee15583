"""Where the ort_lora custom-operator library lives and how to register it with ORT."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIBRARY_NAME = "libort_lora_ops.so"
OPS_DOMAIN = "ort_lora"


def library_path() -> str:
    """Absolute path of the custom-operator library (override with ORT_LORA_LIBRARY)."""
    override = os.environ.get("ORT_LORA_LIBRARY")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"ORT_LORA_LIBRARY={override} is not a file")
        return str(Path(override).resolve())
    # The wheel installs the library beside this file; an editable install keeps Python
    # sources in the checkout and the library in site-packages, so search sys.path too.
    candidates = [Path(__file__).parent / LIBRARY_NAME]
    candidates += [Path(p) / "ort_lora" / LIBRARY_NAME for p in sys.path if p]
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found next to the ort_lora package; install the project with "
        "`pip install .` (it builds the library) or set ORT_LORA_LIBRARY"
    )


def session_options(**config):
    """`onnxruntime.SessionOptions` with the ort_lora ops registered.

    Keyword arguments set attributes of the options (e.g. intra_op_num_threads=2).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.register_custom_ops_library(library_path())
    for key, value in config.items():
        setattr(opts, key, value)
    return opts
