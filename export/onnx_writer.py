"""Trace one graph wrapper to ONNX with dynamic axes; move weights to external data when the file would pass 2 GB."""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from mirrorsd.export.graphs.common import GraphIO
from mirrorsd.export.graphs import attention

OPSET = 17
PROTOBUF_LIMIT = 2 * 1024**3 - 64 * 1024**2  # protobuf's 2 GiB cap, with headroom for the graph itself


def sample_args(io: GraphIO, batch: int = 2, seq: int = 3, past: int = 2) -> tuple[torch.Tensor, ...]:
    """Inputs of the right kinds for tracing; dims differ from each other so no axis is specialised by accident."""
    dims = {"batch_size": batch, "sequence_length": seq, "past_sequence_length": past, "total_sequence_length": past + seq}
    args = []
    for spec in io.inputs:
        shape = [dims[d] if isinstance(d, str) else d for d in spec.shape]
        if spec.dtype == "int64" and spec.name == "attention_mask":
            args.append(torch.ones(shape, dtype=torch.int64))
        elif spec.dtype == "int64":
            args.append(torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 7)
        else:
            args.append(torch.randn(shape, dtype=torch.float32) * 0.1)
    return tuple(args)


def write_onnx(module: torch.nn.Module, io: GraphIO, path: Path) -> Path:
    """Trace into a scratch folder beside ``path``, then place ``path`` (plus ``path.data`` if it is large)."""
    import onnx

    args = sample_args(io)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".trace-{path.stem}-") as scratch:
        traced = Path(scratch) / path.name
        with torch.no_grad(), warnings.catch_warnings(), attention.traced_with_grouped_attention(module):
            warnings.simplefilter("ignore")  # tracer warnings about Python values are expected for config ints
            torch.onnx.export(
                module, args, str(traced), input_names=[t.name for t in io.inputs],
                output_names=[t.name for t in io.outputs], dynamic_axes=io.dynamic_axes(), opset_version=OPSET,
                do_constant_folding=True, dynamo=False)
        written = list(Path(scratch).iterdir())
        if len(written) == 1 and traced.stat().st_size < PROTOBUF_LIMIT:
            shutil.move(str(traced), str(path))
            return path
        model = onnx.load(str(traced), load_external_data=True)  # the tracer wrote one file per weight
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    data = path.with_name(path.name + ".data")
    if data.exists():  # onnx creates it private (0600): make it as readable as the graph
        os.chmod(data, path.stat().st_mode & 0o777)
    return path
