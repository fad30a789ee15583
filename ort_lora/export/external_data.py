"""Streams initializers into one external-data file as they are converted.

Each tensor's bytes are appended to `model.onnx.data` (large ones aligned to 4 KiB so ORT can
map them) and only a small TensorProto that points at them stays in memory, so peak memory is
about one tensor, not one model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

DATA_SUFFIX = ".data"
ALIGN = 4096
INLINE_MAX_BYTES = 1024  # smaller tensors stay inside model.onnx

# numpy dtype name -> ONNX element type; bfloat16 arrives as a uint16 view (see to_bytes)
ONNX_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "uint8": TensorProto.UINT8,
}


class ExternalDataWriter:
    """Appends tensor bytes to `data_path`; returns TensorProtos that reference them."""

    def __init__(self, data_path: Path):
        self.data_path = data_path
        self._file = open(data_path, "wb")  # noqa: SIM115 (closed in close())
        self.bytes_written = 0

    def tensor(self, name: str, data: np.ndarray, elem_type: str) -> TensorProto:
        """A TensorProto for `data` (already in its final dtype; bfloat16 as uint16 bits)."""
        data = np.ascontiguousarray(data)
        proto = TensorProto()
        proto.name = name
        proto.data_type = ONNX_TYPES[elem_type]
        proto.dims.extend(data.shape)
        if data.nbytes <= INLINE_MAX_BYTES:
            proto.raw_data = data.tobytes()
            return proto
        offset = -self._file.tell() % ALIGN
        self._file.write(b"\0" * offset)
        start = self._file.tell()
        self._file.write(memoryview(data.reshape(-1).view(np.uint8)))
        self.bytes_written += data.nbytes
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.data_path.name),
            ("offset", str(start)),
            ("length", str(data.nbytes)),
        ):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        return proto

    def close(self) -> None:
        self._file.close()


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Write the graph proto (its initializers already point into the data file)."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
