"""Unpack a graph's packed weights (mirrorsd-export --weight-storage packed, export/packed_weights.py) with numpy before
a session opens, so that ONNX Runtime and OpenVINO get plain initializers.

ONNX Runtime would fold the unpacking nodes itself, but its constant folding keeps every intermediate tensor until
the whole graph is folded: the Qwen2.5-Coder 1.5B suffix with its Q6_K head peaked at 21.7 GB and took 61 s to load
that way (against 0.9 GB and 1.2 s plain). OpenVINO cannot read the packed graph at all (its MatMulNBits reader needs
constant zero points). Here the ``unpack/...`` nodes are evaluated in order, each intermediate freed after its last
use, and the graph's bytes are rewritten without them: their results become initializers (inline raw data), the
packed initializers only they read are dropped, every other field is copied byte for byte. numpy computes each step
with the IEEE operation ONNX defines (float32 multiply, divide and round-half-even are correctly rounded in both), so
the result equals ONNX Runtime's folding bit for bit (tests/test_packed_weights.py).

Wire fields read and written, besides those of mirrorsd/onnx_wire.py (from onnx.proto):

    ModelProto      graph 7
    GraphProto      node 1, initializer 5
    NodeProto       input 1, output 2, name 3, op_type 4, attribute 5
    AttributeProto  name 1, i 3, ints 8
    TensorProto     dims 1, data_type 2, name 8, raw_data 9, external_data 13 (key 1, value 2), data_location 14
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mirrorsd.errors import GraphFileError
from mirrorsd.names import UNPACK_PREFIX
from mirrorsd.onnx_wire import (LENGTH_DELIMITED, MalformedProtobuf, encode_varint, fields, message_field,
                                read_varint, varint_field)

_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER = 7, 1, 5
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 1, 2, 3, 4, 5
_ATTR_NAME, _ATTR_INT, _ATTR_INTS = 1, 3, 8
_T_DIMS, _T_TYPE, _T_NAME, _T_RAW, _T_EXTERNAL = 1, 2, 8, 9, 13
DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16}
ONNX_TYPE = {np.dtype(v): k for k, v in DTYPES.items()}


@dataclass
class _Node:
    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attributes: dict = field(default_factory=dict)


def _unpacking_spans(buf):
    """(start, end) of every top-level node of the serialized model ``buf`` named ``unpack/...`` (weights are
    skipped by their length)."""
    graph = _graph_span(buf)
    for number, wire, lo, hi in fields(buf, *graph) if graph else ():
        if number == _GRAPH_NODE and wire == LENGTH_DELIMITED and _node_name(buf, lo, hi).startswith(UNPACK_PREFIX):
            yield lo, hi


def has_unpacking(buf) -> bool:
    """Whether the serialized model ``buf`` has a top-level node named ``unpack/...``."""
    return next(_unpacking_spans(buf), None) is not None


def unpacking_outputs(buf) -> set[str]:
    """The tensors the ``unpack/...`` nodes of ``buf`` make (float scales, zero points, codes), which ONNX Runtime
    folds into initializers at load."""
    return {out for lo, hi in _unpacking_spans(buf) for out in _read_node(buf, lo, hi).outputs}


def uses_external_data(buf) -> bool:
    """Whether a top-level initializer of the serialized model ``buf`` keeps its values in an external file."""
    graph = _graph_span(buf)
    for number, wire, lo, hi in fields(buf, *graph) if graph else ():
        if number == _GRAPH_INITIALIZER and wire == LENGTH_DELIMITED:
            if any(f == _T_EXTERNAL for f, _, _, _ in fields(buf, lo, hi)):
                return True
    return False


def unpacked_bytes(path: Path) -> bytes | None:
    """The ONNX file ``path`` with its packed weights unpacked (see the module docstring), or None when it has no
    unpacking nodes (open the file itself). External data stays where it is: load the bytes with the file's folder
    as the external-data folder (devices/kernels.external_data_config)."""
    import mmap

    if not Path(path).stat().st_size:
        return None  # an empty file: opening it says what is wrong
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            if not has_unpacking(buf):
                return None
        except (MalformedProtobuf, ValueError):  # (ValueError: a name that is not UTF-8)
            return None  # not a valid model at all: opening it says what is wrong, as for any graph
        try:
            return unpack_model(buf, Path(path).parent)
        except (MalformedProtobuf, ValueError, KeyError) as exc:
            raise GraphFileError(f"The packed weights of '{Path(path).name}' cannot be unpacked", str(exc),
                                 "the file may be truncated or damaged: re-export the folder") from None


def unpack_model(buf, folder: Path) -> bytes:
    """The serialized model ``buf`` with every ``unpack/...`` node evaluated and replaced by the initializers it
    makes (``folder``: where external data files are)."""
    graph = _graph_span(buf)
    nodes, initializers = graph_contents(buf)
    unpacking = [n for n in nodes.values() if n.name.startswith(UNPACK_PREFIX)]
    read_elsewhere = {name for n in nodes.values() if not n.name.startswith(UNPACK_PREFIX) for name in n.inputs}
    groups: dict[str, list[_Node]] = {}  # one weight's unpacking: its nodes share the name's scope
    for node in unpacking:
        groups.setdefault(node.name.rsplit("/", 1)[0], []).append(node)
    made = []
    for group in groups.values():
        wanted = {out for n in group for out in n.outputs} & read_elsewhere
        results = _evaluate_in_rows(group, lambda name: read_initializer(buf, initializers[name], folder), wanted)
        made += [message_field(_GRAPH_INITIALIZER, _tensor_message(name, value))
                 for name, value in sorted(results.items())]
    dropped = ({name for n in unpacking for name in n.inputs} - read_elsewhere) & set(initializers)
    left_out = {span for span, n in nodes.items() if n.name.startswith(UNPACK_PREFIX)}
    left_out |= {initializers[name] for name in dropped}
    parts = []  # the new GraphProto's fields: kept ones as slices of ``buf`` (copied once, by the join below)
    view = memoryview(buf)
    for number, wire, lo, hi in fields(buf, *graph):
        if not (wire == LENGTH_DELIMITED and (lo, hi) in left_out):
            parts += _field_parts(view, number, wire, lo, hi)
    parts += made
    model = []
    for number, wire, lo, hi in fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == LENGTH_DELIMITED:
            model += [encode_varint(_MODEL_GRAPH << 3 | LENGTH_DELIMITED), encode_varint(sum(map(len, parts)))]
            model += parts
        else:
            model += _field_parts(view, number, wire, lo, hi)
    return b"".join(model)


def graph_contents(buf) -> tuple[dict[tuple[int, int], _Node], dict[str, tuple[int, int]]]:
    """The top-level nodes of the serialized model ``buf`` ((lo, hi) of each NodeProto -> its op type, name, inputs,
    outputs and int attributes) and where each initializer lies (name -> (lo, hi) of its TensorProto); weights are
    skipped by their length. read_initializer reads one."""
    graph = _graph_span(buf)
    nodes, initializers = {}, {}
    for number, wire, lo, hi in fields(buf, *graph) if graph else ():
        if wire != LENGTH_DELIMITED:
            continue
        if number == _GRAPH_NODE:
            nodes[lo, hi] = _read_node(buf, lo, hi)
        elif number == _GRAPH_INITIALIZER:
            initializers[_tensor_name(buf, lo, hi)] = (lo, hi)
    return nodes, initializers


def read_initializer(buf, span: tuple[int, int], folder: Path) -> np.ndarray:
    """The values of the initializer whose TensorProto lies at ``span`` of ``buf`` (raw or external data in
    ``folder``)."""
    return _read_tensor(buf, *span, folder)


CHUNK_BYTES = 8 << 20  # stored bytes per row chunk: the float32 temporaries of a chunk stay near 40-50 MB


def _evaluate_in_rows(nodes: list[_Node], initializer, wanted: set[str]) -> dict[str, np.ndarray]:
    """_evaluate over chunks of rows. Every unpacking node works row by row on tensors whose first axis is the
    weight's N (packed_weights.py: slices, reshapes and reductions on the last axes only, reshapes that start with
    N or flatten the result), so the stored tensors (2-D and more) are cut into row chunks, each reshape's N
    becomes the chunk's, and the chunks' results are joined on axis 0."""
    names = {name for n in nodes for name in n.inputs} - {out for n in nodes for out in n.outputs}
    stored = {name: initializer(name) for name in names}
    rows = {value.shape[0] for value in stored.values() if value.ndim >= 2}
    if len(rows) != 1:
        return _evaluate(nodes, stored.__getitem__, wanted)
    n = rows.pop()
    chunks = max(1, min(n, sum(v.nbytes for v in stored.values() if v.ndim >= 2) // CHUNK_BYTES))
    bounds = np.linspace(0, n, chunks + 1).astype(int)

    def chunk(lo: int, hi: int) -> dict[str, np.ndarray]:
        sliced = {name: (value[lo:hi] if value.ndim >= 2 else value) for name, value in stored.items()}
        return _evaluate(nodes, sliced.__getitem__, wanted, rows=(n, hi - lo))

    pieces: dict[str, list[np.ndarray]] = {}
    with ThreadPoolExecutor(max_workers=min(chunks, os.cpu_count() or 1)) as pool:  # numpy releases the GIL
        for result in pool.map(chunk, bounds[:-1], bounds[1:]):
            for name, value in result.items():
                pieces.setdefault(name, []).append(value)
    return {name: np.concatenate(values, axis=0) if len(values) > 1 else values[0] for name, values in pieces.items()}


def _evaluate(nodes: list[_Node], initializer, wanted: set[str], rows: tuple[int, int] | None = None
              ) -> dict[str, np.ndarray]:
    """Run ``nodes`` in order with numpy; return the ``wanted`` outputs. Intermediates are freed after their last
    use; inputs not made by an earlier node are read with ``initializer(name)``. ``rows`` = (N, n): a reshape to a
    shape that starts with N reshapes to n rows instead (a row chunk)."""
    last_use = {}
    for index, node in enumerate(nodes):
        for name in node.inputs:
            last_use[name] = index
    values: dict[str, np.ndarray] = {}
    results = {}
    for index, node in enumerate(nodes):
        args = [values[name] if name in values else initializer(name) for name in node.inputs]
        if node.op_type == "Reshape" and rows is not None and int(args[1][0]) == rows[0]:
            args[1] = np.concatenate([[rows[1]], args[1][1:]]).astype(np.int64)
        out = _OPS[node.op_type](node, *args)
        values[node.outputs[0]] = out
        for name in node.inputs:
            if last_use.get(name) == index and name in values and name not in wanted:
                del values[name]
        if node.outputs[0] in wanted:
            results[node.outputs[0]] = out
    return results


def _power_of_two(a: np.ndarray, b: np.ndarray) -> int | None:
    """log2(b) when ``a`` is unsigned and ``b`` one power of two (then a // b is a >> k and a % b is a & (b - 1),
    the same numbers, several times faster in numpy); else None."""
    if a.dtype.kind != "u" or b.size != 1 or b.dtype.kind not in "ui":
        return None
    value = int(b.reshape(-1)[0])
    return value.bit_length() - 1 if value > 0 and value & (value - 1) == 0 else None


def _modulo(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    shift = _power_of_two(a, b)
    if shift is not None:
        return a & a.dtype.type((1 << shift) - 1)
    return np.mod(a, b).astype(a.dtype)


def _integer_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    shift = _power_of_two(a, b)
    if shift is not None:
        return a >> a.dtype.type(shift)
    if np.issubdtype(a.dtype, np.integer):
        quotient = np.abs(a) // np.abs(b)  # ONNX truncates toward zero
        return np.where((a < 0) != (b < 0), -quotient, quotient).astype(a.dtype)
    return (a / b).astype(a.dtype)


def _slice(node, data, starts, ends, axes=None, steps=None):
    index = [slice(None)] * data.ndim
    axes = range(len(starts)) if axes is None else axes
    for s, e, a in zip(starts, ends, axes):
        index[int(a)] = slice(int(s), int(e))
    return np.ascontiguousarray(data[tuple(index)])


def _reshape(node, data, shape):
    return data.reshape([int(d) for d in shape])


_OPS = {
    "Cast": lambda n, x: x.astype(DTYPES[n.attributes["to"]]),
    "Slice": _slice,
    "Mod": lambda n, a, b: _modulo(a, b),
    "Div": lambda n, a, b: _integer_divide(a, b),
    "Mul": lambda n, a, b: (a * b).astype(a.dtype),
    "Add": lambda n, a, b: (a + b).astype(a.dtype),
    "Sub": lambda n, a, b: (a - b).astype(a.dtype),
    "Concat": lambda n, *xs: np.concatenate(xs, axis=n.attributes["axis"]),
    "Unsqueeze": lambda n, x, axes: np.expand_dims(x, tuple(int(a) for a in axes)),
    "Reshape": _reshape,
    "Equal": lambda n, a, b: np.equal(a, b),
    "Greater": lambda n, a, b: np.greater(a, b),
    "Where": lambda n, c, a, b: np.where(c, a, b).astype(a.dtype),
    "Abs": lambda n, x: np.abs(x),
    "Round": lambda n, x: np.rint(x),
    "Clip": lambda n, x, low, high: np.clip(x, low, high).astype(x.dtype),
    "ReduceMax": lambda n, x: np.max(x, axis=tuple(n.attributes["axes"]),
                                     keepdims=bool(n.attributes.get("keepdims", 1))),
}


def _graph_span(buf) -> tuple[int, int] | None:
    for number, wire, lo, hi in fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == LENGTH_DELIMITED:
            return lo, hi
    return None


def _field_parts(view: memoryview, number: int, wire: int, lo: int, hi: int) -> list:
    """A field as it was: its key, its length (length-delimited) and its value (a slice of the source)."""
    key = encode_varint(number << 3 | wire)
    if wire == LENGTH_DELIMITED:
        return [key, encode_varint(hi - lo), view[lo:hi]]
    return [key, view[lo:hi]]


def _node_name(buf, lo: int, hi: int) -> str:
    for f, w, a, b in fields(buf, lo, hi):
        if f == _NODE_NAME and w == LENGTH_DELIMITED:
            return bytes(buf[a:b]).decode()
    return ""


def _read_node(buf, lo: int, hi: int) -> _Node:
    node = _Node("", "", [], [])
    for f, w, a, b in fields(buf, lo, hi):
        if w != LENGTH_DELIMITED:
            continue
        text = lambda: bytes(buf[a:b]).decode()  # noqa: E731
        if f == _NODE_INPUT:
            node.inputs.append(text())
        elif f == _NODE_OUTPUT:
            node.outputs.append(text())
        elif f == _NODE_NAME:
            node.name = text()
        elif f == _NODE_OP_TYPE:
            node.op_type = text()
        elif f == _NODE_ATTRIBUTE:
            node.attributes.update(_read_attribute(buf, a, b))
    return node


def _varints(buf, f_wire: int, lo: int, hi: int) -> list[int]:
    """A repeated integer field's values: packed (length-delimited) or a single varint."""
    values, pos = [], lo
    if f_wire == LENGTH_DELIMITED:
        while pos < hi:
            value, pos = read_varint(buf, pos, hi)
            values.append(value)
        return values
    return [read_varint(buf, lo, hi)[0]]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _read_attribute(buf, lo: int, hi: int) -> dict:
    name, value = None, None
    ints = []
    for f, w, a, b in fields(buf, lo, hi):
        if f == _ATTR_NAME and w == LENGTH_DELIMITED:
            name = bytes(buf[a:b]).decode()
        elif f == _ATTR_INT and w == 0:
            value = _signed(read_varint(buf, a, b)[0])
        elif f == _ATTR_INTS:
            ints += [_signed(v) for v in _varints(buf, w, a, b)]
    return {name: ints if ints else value} if name else {}


def _tensor_name(buf, lo: int, hi: int) -> str:
    for f, w, a, b in fields(buf, lo, hi):
        if f == _T_NAME and w == LENGTH_DELIMITED:
            return bytes(buf[a:b]).decode()
    return ""


def _read_tensor(buf, lo: int, hi: int, folder: Path) -> np.ndarray:
    dims, dtype, raw, external = [], None, None, {}
    for f, w, a, b in fields(buf, lo, hi):
        if f == _T_DIMS:
            dims += [_signed(v) for v in _varints(buf, w, a, b)]
        elif f == _T_TYPE and w == 0:
            dtype = DTYPES[read_varint(buf, a, b)[0]]
        elif f == _T_RAW and w == LENGTH_DELIMITED:
            raw = (a, b)
        elif f == _T_EXTERNAL and w == LENGTH_DELIMITED:
            entry = {k: bytes(buf[x:y]).decode() for k, kw, x, y in fields(buf, a, b) if kw == LENGTH_DELIMITED}
            external[entry.get(1, "")] = entry.get(2, "")
    if external:
        offset, length = int(external.get("offset", 0)), int(external["length"])
        with open(folder / external["location"], "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
    elif raw is not None:
        data = bytes(buf[raw[0]:raw[1]])
    else:
        raise ValueError(f"initializer at byte {lo} keeps its values in a typed field, not raw_data")
    return np.frombuffer(data, dtype=dtype).reshape(dims)


def _tensor_message(name: str, value: np.ndarray) -> bytes:
    value = np.ascontiguousarray(value)
    dims = b"".join(varint_field(_T_DIMS, int(d)) for d in value.shape)
    return dims + varint_field(_T_TYPE, ONNX_TYPE[value.dtype]) + message_field(_T_NAME, name.encode()) + \
        message_field(_T_RAW, value.tobytes())
