"""Read a .safetensors file into float32 numpy arrays, bfloat16 included, without torch.

Format: 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
data block; offsets are relative to the start of the data block.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ort_lora.adapters.errors import AdapterError
from ort_lora.bfloat16 import bfloat16_bits_to_float32

_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),  # converted below
}


def load_float32(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as C-contiguous float32 arrays."""
    path = Path(path)
    raw = path.read_bytes()
    header, data = _split(raw, path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(name, info, data, path)
    return out


def _split(raw: bytes, path: Path) -> tuple[dict, memoryview]:
    if len(raw) < 8:
        raise AdapterError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise AdapterError(f"{path}: safetensors header length {n} exceeds the file size")
    try:
        header = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: safetensors header must be a JSON object")
    return header, memoryview(raw)[8 + n :]


def _tensor(name: str, info: dict, data: memoryview, path: Path) -> np.ndarray:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{path}: tensor {name!r} has a malformed header entry") from None
    if dtype_name not in _DTYPES:
        raise AdapterError(
            f"{path}: tensor {name!r} has dtype {dtype_name}; expected one of {sorted(_DTYPES)}"
        )
    dtype = _DTYPES[dtype_name]
    count = int(np.prod(shape, dtype=np.int64))
    if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
        raise AdapterError(
            f"{path}: tensor {name!r} data range [{begin}, {end}) does not fit its shape "
            f"{shape} x {dtype_name} or the file"
        )
    arr = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
    if dtype_name == "BF16":
        return bfloat16_bits_to_float32(arr)
    return np.ascontiguousarray(arr, dtype=np.float32)
