"""Let a graph score only its last rows: a ``logits_from`` input that the LM head's rows start at.

An exported graph (the draft, the target's suffix) ends in its LM head, one MatMulNBits over every row the call
feeds. A prompt is read 256 rows a call, and only the last row's logits of the last chunk are ever used (the
target's first token; the draft keeps none), yet every chunk scored all of its rows: on the Qwen2.5-Coder pair the
head is ~27 % of a 0.5B draft row's multiply-adds and ~15 % of a 1.5B target row's, and each chunk wrote 155 MB of
logits nobody read.

``logits_from_input`` rewrites the graph at load (mirrorsd/onnx_wire.py, no onnx package), the head's input sliced
along the rows:

    normed [B, S, H]  ->  Slice(normed, starts=logits_from, ends=INT64_MAX, axes=[1])  [B, S - logits_from, H]
    logits = MatMulNBits(sliced)                                                        [B, S - logits_from, vocab]

``logits_from`` is an int64 input of shape [1]: 0 scores every row (what the exported graph does), S - 1 the last
one. A row's logits do not depend on how many rows the head multiplies where mirrorsd's kernels run it (their
results are row-invariant: tests/test_kernels.py), so the runtime applies the rewrite there only, and a prompt's
last row is scored to the same bits as before. A graph whose logits do not come straight from one MatMulNBits, or
that reads them itself, is left as it is.
"""
from __future__ import annotations

import struct

from mirrorsd.devices.kernels.attention_rewrite import (_GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_NODE, _NODE_INPUT,
                                                        _VALUE_INFO_NAME, _Node, _read_graph, _with_graph)
from mirrorsd.onnx_wire import LENGTH_DELIMITED, MalformedProtobuf, fields, message_field, varint_field

LOGITS_FROM = "logits_from"  # the input the rewritten graph takes: int64 [1], the first row whose logits it computes
_HEAD_OP, _HEAD_DOMAIN = "MatMulNBits", "com.microsoft"
_INT64 = 7  # TensorProto.DataType
_NODE_NAME, _NODE_OP_TYPE, _NODE_DOMAIN = 3, 4, 7
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW = 1, 2, 8, 9
_VALUE_INFO_TYPE, _TYPE_TENSOR, _TENSOR_ELEM_TYPE, _TENSOR_SHAPE, _SHAPE_DIM, _DIM_VALUE = 2, 1, 1, 2, 1, 1


def logits_from_input(model: bytes, logits: str) -> tuple[bytes, bool]:
    """``model`` (a serialized ModelProto) with its ``logits`` output computed from row ``logits_from`` on, and
    whether it changed; (``model``, False) when ``logits`` is not one MatMulNBits node's output."""
    parts = _read_graph(model)
    if parts is None or logits not in parts.outputs or LOGITS_FROM in parts.inputs:
        return model, False
    heads = [n for n in parts.nodes if logits in n.output]
    if (len(heads) != 1 or heads[0].op_type != _HEAD_OP or heads[0].domain != _HEAD_DOMAIN
            or heads[0].output != [logits] or not heads[0].input
            or any(logits in n.input for n in parts.nodes)):  # a node that reads every row's logits
        return model, False
    head = heads[0]
    sliced = f"{head.input[0]}/{LOGITS_FROM}"
    ends, axes = f"{sliced}/ends", f"{sliced}/axes"
    pieces = []
    for node in parts.nodes:
        if node is head:
            pieces.append(message_field(_GRAPH_NODE, _slice_node(head.input[0], sliced, ends, axes)))
            pieces.append(message_field(_GRAPH_NODE, _with_first_input(head, sliced)))
        else:
            pieces.append(message_field(_GRAPH_NODE, node.raw))
    pieces += [bytes(piece) for _, _, piece in parts.rest]
    pieces += [message_field(_GRAPH_INITIALIZER, _int64_tensor(ends, 2**63 - 1)),
               message_field(_GRAPH_INITIALIZER, _int64_tensor(axes, 1)),
               message_field(_GRAPH_INPUT, _int64_input(LOGITS_FROM))]
    return _with_graph(model, parts.span, b"".join(pieces)), True


def _slice_node(data: str, out: str, ends: str, axes: str) -> bytes:
    inputs = b"".join(message_field(_NODE_INPUT, name.encode()) for name in (data, LOGITS_FROM, ends, axes))
    return (inputs + message_field(2, out.encode()) + message_field(_NODE_NAME, out.encode())
            + message_field(_NODE_OP_TYPE, b"Slice"))


def _with_first_input(node: _Node, name: str) -> bytes:
    """``node``'s bytes with its first input renamed (every NodeProto field is length-delimited)."""
    out, renamed = [], False
    for f, w, lo, hi in fields(node.raw, 0, len(node.raw)):
        if w != LENGTH_DELIMITED:
            raise MalformedProtobuf(f"a NodeProto field {f} that is not length-delimited")
        payload = node.raw[lo:hi]
        if f == _NODE_INPUT and not renamed:
            payload, renamed = name.encode(), True
        out.append(message_field(f, payload))
    return b"".join(out)


def _int64_tensor(name: str, value: int) -> bytes:
    """A TensorProto holding one int64, shape [1]."""
    return (varint_field(_TENSOR_DIMS, 1) + varint_field(_TENSOR_DATA_TYPE, _INT64)
            + message_field(_TENSOR_NAME, name.encode()) + message_field(_TENSOR_RAW, struct.pack("<q", value)))


def _int64_input(name: str) -> bytes:
    """ValueInfoProto of an int64 input of shape [1]."""
    shape = message_field(_SHAPE_DIM, varint_field(_DIM_VALUE, 1))
    tensor = varint_field(_TENSOR_ELEM_TYPE, _INT64) + message_field(_TENSOR_SHAPE, shape)
    return message_field(_VALUE_INFO_NAME, name.encode()) + message_field(_VALUE_INFO_TYPE,
                                                                          message_field(_TYPE_TENSOR, tensor))


__all__ = ["LOGITS_FROM", "logits_from_input"]
