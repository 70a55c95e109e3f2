"""Switch a graph's MatMulNBits nodes between ONNX Runtime's kernel and mirrorsd's, by editing the ONNX bytes.

A node's kernel is chosen by its (domain, op_type). "mirrorsd.kern" and "com.microsoft" have the same length, so the
switch overwrites each MatMulNBits node's domain string in place: no length prefix changes, the weights are not
touched, and the same function switches back. The model also needs an opset_import for the domain it now uses; one
is appended to the top-level ModelProto when missing (protobuf fields may come in any order):

    ModelProto  opset_import 8 -> OperatorSetIdProto { domain 1, version 2 }
    NodeProto   op_type 4, domain 7          (found with mirrorsd/onnx_wire.py's field walker)

A node whose inputs the kernel refuses (zero points that are neither a float initializer nor made by the nodes that
unpack packed weights, devices/unpack.py, which become float initializers at load; packed uint8 zero points;
g_idx) or whose attributes it does not handle (bits other than 4 and 8, block_size other than 32) keeps ONNX
Runtime's kernel. Float zero points are read from the initializers' data type:

    TensorProto  data_type 2 (1 = FLOAT), name 8
"""
from __future__ import annotations

from pathlib import Path

from mirrorsd.devices.unpack import unpacking_outputs
from mirrorsd.errors import GraphFileError
from mirrorsd.onnx_wire import (LENGTH_DELIMITED, MalformedProtobuf, fields, message_field, messages, read_varint,
                                varint_field)

DOMAIN = "mirrorsd.kern"
ORT_DOMAIN = "com.microsoft"
OP_TYPE = b"MatMulNBits"
_NODE_INPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 4, 5, 7
_ATTRIBUTE_NAME, _ATTRIBUTE_INT = 1, 3
_MODEL_OPSET_IMPORT, _OPSET_DOMAIN, _OPSET_VERSION = 8, 1, 2
_SUPPORTED = {b"bits": (4, 8), b"block_size": (32,)}
_ZERO_POINTS, _GROUP_INDEX = 3, 4  # input indices
_TENSOR_DATA_TYPE, _TENSOR_NAME, _FLOAT = 2, 8, 1


def switch_domain(model: bytearray, to: str = DOMAIN) -> int:
    """Move every supported MatMulNBits node of ``model`` (a serialized ModelProto, edited in place) to the domain
    ``to`` (DOMAIN or ORT_DOMAIN) and make sure the model imports it. Returns the number of nodes switched."""
    if to not in (DOMAIN, ORT_DOMAIN):
        raise ValueError(f"domain {to!r} is neither {DOMAIN!r} nor {ORT_DOMAIN!r}")
    source = (ORT_DOMAIN if to == DOMAIN else DOMAIN).encode()
    try:
        spans = [span for span in _matmul_nbits_domains(model, source)]
        for lo, hi in spans:
            model[lo:hi] = to.encode()  # same length: nothing around it moves
        if spans and to not in _opset_domains(model):
            model += _opset_import(to, 1)
    except MalformedProtobuf as exc:
        raise GraphFileError("The graph is not a valid ONNX model", f"{exc} (truncated or damaged)",
                             "re-export the folder") from None
    return len(spans)


def read_switched(path: Path, to: str = DOMAIN) -> tuple[bytes, int]:
    """The bytes of the ONNX file ``path`` with its MatMulNBits nodes moved to ``to``, and how many moved.

    Loading these bytes needs the session config entry ``session.model_external_initializers_file_folder_path``
    set to ``path``'s folder when the graph keeps weights in external data files (see external_data_config)."""
    model = bytearray(Path(path).read_bytes())
    count = switch_domain(model, to)
    return bytes(model), count


def imports_ort_domain(path: Path) -> bool:
    """Whether the ONNX file ``path`` imports ONNX Runtime's contrib domain (the only way it can hold MatMulNBits).
    Reads the top-level fields only, skipping the graph by its length (the file is mapped, not read)."""
    import mmap

    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return ORT_DOMAIN in _opset_domains(mapped)
    except (MalformedProtobuf, ValueError) as exc:
        raise GraphFileError(f"Graph file '{Path(path).name}' is not a valid ONNX model", str(exc),
                             "re-export the folder") from None


def external_data_config(path: Path) -> dict[str, str]:
    """The session config entries under which ONNX Runtime finds ``path``'s external data when given its bytes."""
    return {"session.model_external_initializers_file_folder_path": str(Path(path).resolve().parent)}


def _matmul_nbits_domains(model, source: bytes) -> list[tuple[int, int]]:
    """(start, end) of the domain string of every supported MatMulNBits node in domain ``source``."""
    spans = []
    float_tensors = None  # names of float initializers, read when a node has zero points
    for start, end in messages(model, "node"):
        op_type = domain = None
        inputs, attributes = [], {}
        for field, wire, lo, hi in fields(model, start, end):
            if wire != LENGTH_DELIMITED:
                continue
            if field == _NODE_OP_TYPE:
                op_type = bytes(model[lo:hi])
            elif field == _NODE_DOMAIN:
                domain = (lo, hi)
            elif field == _NODE_INPUT:
                inputs.append(bytes(model[lo:hi]))
            elif field == _NODE_ATTRIBUTE:
                attributes.update(_int_attribute(model, lo, hi))
        if op_type != OP_TYPE or not domain or bytes(model[domain[0]:domain[1]]) != source:
            continue
        zero_points = inputs[_ZERO_POINTS] if len(inputs) > _ZERO_POINTS else b""
        if zero_points and float_tensors is None:
            float_tensors = _float_tensors(model) | {name.encode() for name in unpacking_outputs(model)}
        if _supported(inputs, attributes, not zero_points or zero_points in float_tensors):
            spans.append(domain)
    return spans


def _supported(inputs: list[bytes], attributes: dict[bytes, int], float_zero_points: bool) -> bool:
    if not float_zero_points or (len(inputs) > _GROUP_INDEX and inputs[_GROUP_INDEX]):
        return False
    return all(attributes.get(name) in allowed for name, allowed in _SUPPORTED.items())


def _float_tensors(model) -> set[bytes]:
    """Names of the model's float32 tensors (initializers, and tensors inside attributes)."""
    names = set()
    for start, end in messages(model, "tensor"):
        name, data_type = _name_and_int(model, start, end, _TENSOR_NAME, _TENSOR_DATA_TYPE)
        if name and data_type == _FLOAT:
            names.add(name)
    return names


def _int_attribute(model, start: int, end: int) -> dict[bytes, int]:
    name, value = _name_and_int(model, start, end, _ATTRIBUTE_NAME, _ATTRIBUTE_INT)
    return {name: value} if name is not None and value is not None else {}


def _name_and_int(model, start: int, end: int, name_field: int, int_field: int) -> tuple[bytes | None, int | None]:
    """A message's string field ``name_field`` and varint field ``int_field`` (None where absent)."""
    name, value = None, None
    for field, wire, lo, hi in fields(model, start, end):
        if field == name_field and wire == LENGTH_DELIMITED:
            name = bytes(model[lo:hi])
        elif field == int_field and wire == 0:
            value = read_varint(model, lo, hi)[0]
    return name, value


def _opset_domains(model) -> set[str]:
    domains = set()
    for field, wire, lo, hi in fields(model, 0, len(model)):
        if field == _MODEL_OPSET_IMPORT and wire == LENGTH_DELIMITED:
            entry = {f: bytes(model[a:b]) for f, w, a, b in fields(model, lo, hi) if w == LENGTH_DELIMITED}
            domains.add(entry.get(_OPSET_DOMAIN, b"").decode())
    return domains


def _opset_import(domain: str, version: int) -> bytes:
    return message_field(_MODEL_OPSET_IMPORT,
                         message_field(_OPSET_DOMAIN, domain.encode()) + varint_field(_OPSET_VERSION, version))
