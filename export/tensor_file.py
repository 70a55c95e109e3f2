"""Write a graph's weights into ``NAME.onnx.data`` as they are made, and the graph itself last.

    TensorFile(path)      .add(name, array) / .add_proto(tensor)  -> a TensorProto stub pointing into path.data
                          .finish(model)   -> path (+ path.data), laid out as the whole-graph exporter lays out:
                                              one file when everything fits under protobuf's 2 GB, else the graph
                                              plus NAME.onnx.data (tensors under 1 KB stay in the graph)

Tensors start at 4 KiB boundaries, so ONNX Runtime can map them straight from the file.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mirrorsd.export import onnx_writer

INLINE_BELOW = 1024  # bytes: smaller tensors stay in the graph (onnx's own size_threshold default)
ALIGN = 4096


def onnx_dtypes() -> dict[str, int]:
    from onnx import TensorProto

    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64}


class TensorFile:
    """The external-data file of one graph, written front to back; a context manager that removes it on error."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.data = self.path.with_name(self.path.name + ".data")
        self.handle = None
        self.offset = 0

    def __enter__(self) -> "TensorFile":
        self.handle = open(self.data, "wb")
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.handle is not None:
            self.handle.close()
        if exc is not None:
            self.data.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)

    def add(self, name: str, array: np.ndarray):
        from onnx import TensorProto, helper

        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BELOW:
            from onnx import numpy_helper

            return numpy_helper.from_array(array, name)
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        self._append(tensor, memoryview(array).cast("B"))
        return tensor

    def add_proto(self, tensor):
        """Move a tensor's inline bytes into the file (small ones stay inline); returns the same proto."""
        if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BELOW:
            return tensor
        raw = tensor.raw_data
        tensor.ClearField("raw_data")
        self._append(tensor, raw)
        return tensor

    def _append(self, tensor, raw) -> None:
        from onnx import TensorProto

        pad = -self.offset % ALIGN
        self.handle.write(b"\0" * pad)
        self.offset += pad
        self.handle.write(raw)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data.name), ("offset", str(self.offset)), ("length", str(len(raw)))):
            tensor.external_data.add(key=key, value=value)
        self.offset += len(raw)

    def finish(self, model) -> Path:
        """Write the graph; fold the data back into it when the whole fits in one protobuf file."""
        import onnx

        self.handle.close()
        self.handle = None
        if self.offset + model.ByteSize() < onnx_writer.PROTOBUF_LIMIT:
            onnx.load_external_data_for_model(model, str(self.path.parent))
            onnx.save_model(model, str(self.path))
            self.data.unlink()
        else:
            onnx.save_model(model, str(self.path))
            os.chmod(self.data, self.path.stat().st_mode & 0o777)
        return self.path
