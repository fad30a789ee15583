"""Read a .safetensors file into float32 numpy arrays, bfloat16 included, without torch.

Format: 8-byte little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
data block; offsets are relative to the start of the data block.

Adapter files are untrusted. The file is memory-mapped, never read whole: the header is
parsed and every entry checked (types, sizes, ranges inside the file) before any tensor data
is touched, a caller can check the shapes it expects first (`SafetensorsFile.tensors`), then
takes views of the tensors (`view`) and copies them where they go: one copy out of the map,
into memory allocated once (a temporary array per tensor costs more in first touches of its
pages than the copy itself). `check_finite` names a tensor holding NaN or inf. Error messages
name the file as the caller calls it (`where`: never the path it was opened by, the server's
layout) and a header entry by its place in the header, never show the file's bytes (tensor
names included).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from dataclasses import dataclass
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
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_DIMS = 8


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, checked: its data lies at [begin, end) of the data block."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """An open .safetensors file: `tensors` (the checked header), `read(name)`. A context
    manager; AdapterError on any malformed part."""

    def __init__(self, path: str | Path, where: str | None = None):
        self.path = Path(path)
        self.where = where or self.path.name
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise AdapterError(f"{self.where}: not a safetensors file (shorter than 8 bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.tensors, self._data_start = _header(self._map, self.where)
        except BaseException:
            self._map.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        # a view still referenced (a traceback's frame) keeps the map open until it is freed
        with contextlib.suppress(BufferError):
            self._map.close()

    def view(self, name: str) -> np.ndarray:
        """The tensor's values, read-only: a view of the map (float32, float16 or float64 as
        stored: assigning it into a float32 array converts), BF16 converted to a float32 copy.
        Every view must be dropped before the file closes."""
        info = self.tensors[name]
        raw = np.frombuffer(self._map, _DTYPES[info.dtype], offset=self._data_start + info.begin,
                            count=int(np.prod(info.shape, dtype=np.int64)))  # fmt: skip
        raw = raw.reshape(info.shape)
        return bfloat16_bits_to_float32(raw) if info.dtype == "BF16" else raw

    def check_finite(self, names: dict[str, str]) -> None:
        """AdapterError naming the first of these tensors that holds NaN or inf. names: tensor
        name -> how the error calls it (not by its name in the file: file contents)."""
        for name, shown in names.items():
            v = self.view(name).astype(np.float32, copy=False)  # as served: 1e300 is inf
            bad = int(np.size(v) - np.isfinite(v).sum())
            del v
            if bad:
                raise AdapterError(f"{self.where}: tensor {shown} holds {bad} NaN or inf values")


def _header(buf: mmap.mmap, path: str) -> tuple[dict[str, TensorInfo], int]:
    (n,) = struct.unpack("<Q", buf[:8])
    if n > min(len(buf) - 8, MAX_HEADER_BYTES):
        raise AdapterError(f"{path}: not a safetensors file (its header length is invalid)")
    try:
        header = json.loads(buf[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise AdapterError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path}: safetensors header must be a JSON object")
    data_len = len(buf) - 8 - n
    tensors = {
        name: _entry(f"#{i} of the header", info, data_len, path)
        for i, (name, info) in enumerate(header.items())
        if name != "__metadata__"
    }
    return tensors, 8 + n


def _entry(name: str, info, data_len: int, path: str) -> TensorInfo:
    """name: how errors call the entry (its place in the header, not its name in the file)."""
    if not isinstance(info, dict):
        raise AdapterError(f"{path}: tensor {name} has a malformed header entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise AdapterError(
            f"{path}: tensor {name} has a dtype that is not one of {sorted(_DTYPES)}"
        )
    if not _ints(shape, MAX_DIMS) or not _ints(offsets, 2, exact=True):
        raise AdapterError(
            f"{path}: tensor {name}: shape must be a list of at most {MAX_DIMS} integers "
            ">= 0 and data_offsets a list of two integers >= 0"
        )
    begin, end = offsets
    count = int(np.prod(shape, dtype=object))  # exact: no overflow for hostile shapes
    if not begin <= end <= data_len or end - begin != count * _DTYPES[dtype].itemsize:
        raise AdapterError(
            f"{path}: tensor {name} data range [{begin}, {end}) does not fit its shape "
            f"{shape} x {dtype} or the file"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _ints(value, size: int, exact: bool = False) -> bool:
    """A list of `size` (or at most `size`) integers >= 0 (bools excluded)."""
    if not isinstance(value, list) or len(value) > size or (exact and len(value) != size):
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
