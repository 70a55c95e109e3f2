"""The ONNX protobuf wire format, read and written without the onnx package.

onnx is an export-time dependency (the runtime installs without it), and ``onnx.load`` turns every inline weight
into Python objects. These helpers walk a serialized ModelProto (bytes, bytearray or mmap) by field number instead,
skipping weight bytes by their length, and write the few fields that tiny hand-built graphs need. Protobuf field
numbers never change once published; these are all the walk follows (from onnx.proto):

    ModelProto          graph 7, training_info 20, functions 25
    TrainingInfoProto   initialization 1, algorithm 2          (GraphProto)
    FunctionProto       node 7
    GraphProto          node 1, initializer 5, sparse_initializer 15
    NodeProto           attribute 5
    AttributeProto      t 5, g 6, tensors 10, graphs 11, sparse_tensor 22, sparse_tensors 23
    SparseTensorProto   values 1, indices 2                    (TensorProto)
    TensorProto         data_type 2, name 8, external_data 13  (StringStringEntryProto: key 1, value 2)

Used by runtime/graph_files.py (external data locations), the kernels library's graph rewrite (operator domains)
and the device probes (tiny graphs built by hand).
"""
from __future__ import annotations

# message kind -> {field number: kind of the embedded message}; "tensor" is read, not walked.
_WALK = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
}
LENGTH_DELIMITED = 2


class MalformedProtobuf(Exception):
    """The bytes are not a well-formed protobuf message (truncated or damaged)."""


def messages(buf, kind: str):
    """Yield (start, end) of every message of ``kind`` ("node", "tensor", a key of _WALK) in the ModelProto ``buf``
    (bytes, bytearray or mmap), subgraphs and functions included. Raises MalformedProtobuf on damaged bytes."""
    stack = [("model", 0, len(buf))]  # an explicit stack: nesting depth is the file's to choose
    while stack:
        current, start, end = stack.pop()
        if current == kind:
            yield start, end
        if current == "tensor":
            continue
        children = _WALK[current]
        for field, wire, lo, hi in fields(buf, start, end):
            if wire == LENGTH_DELIMITED and field in children:
                stack.append((children[field], lo, hi))


def fields(buf, pos: int, end: int):
    """Yield (field number, wire type, value start, value end) of each field in buf[pos:end]."""
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, stop = read_varint(buf, pos, end)
        elif wire == 1:
            stop = pos + 8
        elif wire == 2:
            length, pos = read_varint(buf, pos, end)
            stop = pos + length
        elif wire == 5:
            stop = pos + 4
        else:  # 3 and 4 are protobuf groups, which ONNX never uses; 6 and 7 do not exist
            raise MalformedProtobuf(f"wire type {wire} at byte {pos}")
        if field == 0 or stop > end:
            raise MalformedProtobuf(f"a field runs past the end of its message at byte {pos}")
        yield field, wire, pos, stop
        pos = stop


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise MalformedProtobuf(f"a number breaks off at byte {pos}")


def read_text(buf, lo: int, hi: int) -> str:
    try:
        return buf[lo:hi].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedProtobuf(f"a name at byte {lo} is not UTF-8") from None


def encode_varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint (7 bits per byte, low bits first)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    """A protobuf integer field (wire type 0)."""
    return encode_varint(number << 3) + encode_varint(value)


def message_field(number: int, payload: bytes) -> bytes:
    """A protobuf length-delimited field (a string, bytes or an embedded message)."""
    return encode_varint(number << 3 | LENGTH_DELIMITED) + encode_varint(len(payload)) + payload
