"""Refuse an ONNX graph whose tensors live outside its export folder, before any backend opens it.

An ONNX file may keep tensors in external files named by a ``location`` string; ONNX Runtime and OpenVINO read
whatever it names. A folder someone sent you could point one at ``../../.ssh/id_rsa`` or ``/etc/shadow`` (read into
a weight, and from there into logits), so every location must stay beside its graph, like the manifest's file names.

Why a scan of the protobuf wire format instead of ``onnx.load(path, load_external_data=False)``: onnx is an
export-time dependency (the runtime installs without it, STYLE.md 14), and ``onnx.load`` turns every inline weight
into Python objects (seconds and a second copy in memory for a large graph). The scan maps the file and only walks
the messages that can hold tensors, skipping weight bytes by their length. Protobuf field numbers never change once
published, and these are all it needs (from onnx.proto):

    ModelProto          graph 7, training_info 20, functions 25
    TrainingInfoProto   initialization 1, algorithm 2          (GraphProto)
    FunctionProto       node 7
    GraphProto          node 1, initializer 5, sparse_initializer 15
    NodeProto           attribute 5
    AttributeProto      t 5, g 6, tensors 10, graphs 11, sparse_tensor 22, sparse_tensors 23
    SparseTensorProto   values 1, indices 2                    (TensorProto)
    TensorProto         name 8, external_data 13               (StringStringEntryProto: key 1, value 2)

tests/test_reliability_load.py checks the scan against onnx's own parser.
"""
from __future__ import annotations

import mmap
from pathlib import Path

from mirrorsd.errors import GraphFileError, ManifestError
from mirrorsd.manifest import check_inside

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


def check_external_data(path: Path) -> None:
    """Raise GraphFileError if ``path`` is not a readable protobuf or names external data outside its folder."""
    for tensor, location in external_locations(path):
        try:
            check_inside(path.parent, location, f"tensor '{tensor}'")
        except ManifestError as exc:
            raise GraphFileError(
                f"Graph '{path.name}' reads tensor '{tensor}' from outside its folder: {location!r}", exc.why,
                "do not use this folder; re-export the model yourself") from None


def external_locations(path: Path) -> list[tuple[str, str]]:
    """(tensor name, external data location) of every tensor in the ONNX file at ``path``, subgraphs included."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _scan(mapped)  # indexing an mmap copies nothing; slicing copies only that slice
    except (MalformedProtobuf, ValueError) as exc:  # mmap raises ValueError for an empty file
        raise GraphFileError(f"Graph file '{path.name}' is not a valid ONNX file", f"{exc} (truncated or damaged)",
                             "re-export the folder") from None


def _scan(buf: mmap.mmap) -> list[tuple[str, str]]:
    found = []
    for start, end in messages(buf, "tensor"):
        found += _tensor_locations(buf, start, end)
    return found


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


def _tensor_locations(buf: mmap.mmap, start: int, end: int) -> list[tuple[str, str]]:
    name, locations = "", []
    for field, wire, lo, hi in fields(buf, start, end):
        if wire != LENGTH_DELIMITED:
            continue
        if field == 8:
            name = _text(buf, lo, hi)
        elif field == 13:
            entry = {f: _text(buf, a, b) for f, w, a, b in fields(buf, lo, hi) if w == LENGTH_DELIMITED}
            if entry.get(1) == "location":
                locations.append(entry.get(2, ""))
    return [(name, loc) for loc in locations]


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


def read_varint(buf: mmap.mmap, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise MalformedProtobuf(f"a number breaks off at byte {pos}")


def _text(buf: mmap.mmap, lo: int, hi: int) -> str:
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
