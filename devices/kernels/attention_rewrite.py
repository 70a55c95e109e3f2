"""Put mirrorsd's fused attention (src/attention.cpp, ``mirrorsd.kern::GroupedAttention``) into an exported graph.

An exported layer spends ~30 small nodes on its attention (eager attention as PyTorch traced it, one layer):

    q, k, v = MatMulNBits(x) + bias                          [B, S, heads * D], [B, S, kv_heads * D]
    q4, k4, v4 = Transpose(Reshape(q / k / v))               [B, heads or kv_heads, S, D]
    q4, k4 = q4 * cos + rotate_half(q4) * sin, ...           rotate_half = Concat(Neg(Slice), Slice)
    present_k, present_v = Concat(past_k, k4), Concat(past_v, v4)
    y = Softmax(q4 @ present_k^T * scale + mask) @ present_v -> Reshape/Transpose/Reshape -> [B, S, heads * D]

On a small draft those nodes cost a quarter of a forward on ONNX Runtime's CPU, more than the bytes of its weights
(docs/lab-notes/performance-log.md). ``fuse_attention`` replaces each such layer with one GroupedAttention node
(q, k, v, cos, sin, mask, past_k, past_v -> y, present_k, present_v) and drops the nodes nothing reads any more.
It works on the serialized model with mirrorsd/onnx_wire.py (the runtime installs without the onnx package): the
nodes are read, the kept ones copied as they were, the new ones written, and every other field (the weights) copied
as bytes. A graph whose attention does not have exactly this shape in every layer is left as it is (count 0), so a
graph from another exporter, or a model with extra steps between its projections and rotary (q/k norms), keeps
its own nodes. The session must register mirrorsd's library (devices/kernels) to run the result.
"""
from __future__ import annotations

import struct
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.devices.kernels.rewrite import DOMAIN, _opset_domains, _opset_import
from mirrorsd.onnx_wire import (LENGTH_DELIMITED, MalformedProtobuf, encode_varint, fields, message_field,
                                read_varint, varint_field)

OP_TYPE = "GroupedAttention"
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT = 1, 5, 11, 12
_VALUE_INFO_NAME = 1
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 3, 4, 5, 7
_ATTRIBUTE_NAME, _ATTRIBUTE_FLOAT, _ATTRIBUTE_INT, _ATTRIBUTE_TENSOR, _ATTRIBUTE_TYPE = 1, 2, 3, 5, 20
_FLOAT_ATTRIBUTE, _INT_ATTRIBUTE = 1, 2  # AttributeProto.AttributeType
_TENSOR_DATA_TYPE, _TENSOR_FLOATS, _TENSOR_INT64S, _TENSOR_NAME, _TENSOR_RAW = 2, 4, 7, 8, 9
_TENSOR_TYPES = {1: np.float32, 7: np.int64}  # TensorProto.DataType: the constants this rewrite reads


@dataclass
class _Node:
    """What the rewrite reads of a NodeProto, and its bytes (a kept node is written back unchanged)."""

    raw: bytes
    op_type: str = ""
    domain: str = ""
    input: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    value: tuple[int, int] | None = None  # a Constant's tensor (its span in the model)


def _read_node(model, lo: int, hi: int) -> _Node:
    node = _Node(bytes(model[lo:hi]))
    for f, w, a, b in fields(model, lo, hi):
        if w != LENGTH_DELIMITED:
            continue
        if f == _NODE_INPUT:
            node.input.append(_text(model, a, b))
        elif f == _NODE_OUTPUT:
            node.output.append(_text(model, a, b))
        elif f == _NODE_OP_TYPE:
            node.op_type = _text(model, a, b)
        elif f == _NODE_DOMAIN:
            node.domain = _text(model, a, b)
        elif f == _NODE_ATTRIBUTE:
            node.value = next(((c, d) for g, x, c, d in fields(model, a, b)
                               if g == _ATTRIBUTE_TENSOR and x == LENGTH_DELIMITED), node.value)
    return node


def _node_bytes(op_type: str, inputs: list[str], outputs: list[str], name: str, domain: str,
                ints: dict[str, int], floats: dict[str, float]) -> bytes:
    """A serialized NodeProto with int and float attributes."""
    out = b"".join(message_field(_NODE_INPUT, i.encode()) for i in inputs)
    out += b"".join(message_field(_NODE_OUTPUT, o.encode()) for o in outputs)
    out += message_field(_NODE_NAME, name.encode()) + message_field(_NODE_OP_TYPE, op_type.encode())
    out += message_field(_NODE_DOMAIN, domain.encode())
    for key, value in ints.items():
        out += message_field(_NODE_ATTRIBUTE, message_field(_ATTRIBUTE_NAME, key.encode()) + varint_field(
            _ATTRIBUTE_INT, value) + varint_field(_ATTRIBUTE_TYPE, _INT_ATTRIBUTE))
    for key, value in floats.items():
        out += message_field(_NODE_ATTRIBUTE, message_field(_ATTRIBUTE_NAME, key.encode()) + encode_varint(
            _ATTRIBUTE_FLOAT << 3 | 5) + struct.pack("<f", value) + varint_field(_ATTRIBUTE_TYPE, _FLOAT_ATTRIBUTE))
    return out


def _tensor_values(model, lo: int, hi: int) -> np.ndarray:
    """The values of a small float32 or int64 TensorProto (raw_data, or the typed repeated field)."""
    data_type, raw, floats, ints = None, None, [], []
    for f, w, a, b in fields(model, lo, hi):
        if f == _TENSOR_DATA_TYPE and w == 0:
            data_type = read_varint(model, a, b)[0]
        elif f == _TENSOR_RAW and w == LENGTH_DELIMITED:
            raw = bytes(model[a:b])
        elif f == _TENSOR_FLOATS:
            floats.append(bytes(model[a:b]))  # packed (length-delimited) or one fixed32
        elif f == _TENSOR_INT64S:
            if w == LENGTH_DELIMITED:
                pos = a
                while pos < b:
                    value, pos = read_varint(model, pos, b)
                    ints.append(value)
            else:
                ints.append(read_varint(model, a, b)[0])
    if data_type not in _TENSOR_TYPES:
        raise NotThisShape(f"a constant of data type {data_type}")
    if raw is not None:
        return np.frombuffer(raw, dtype=np.dtype(_TENSOR_TYPES[data_type]).newbyteorder("<"))
    if data_type == 1:
        return np.frombuffer(b"".join(floats), dtype="<f4")
    return np.array([v - (1 << 64) if v >= 1 << 63 else v for v in ints], np.int64)  # two's complement


def _text(model, lo: int, hi: int) -> str:
    return bytes(model[lo:hi]).decode("utf-8", errors="replace")


class NotThisShape(Exception):
    """A layer's attention is not the traced eager attention this rewrite knows."""


@dataclass(frozen=True)
class Layer:
    """The tensors one GroupedAttention node reads and writes, found in the graph."""

    q: str  # [B, S, heads * D] before rotary
    k: str
    v: str
    cos: str  # [B, S, D]
    sin: str
    mask: str  # [B, 1, S, T]
    past_k: str
    past_v: str
    y: str  # what the layer's output projection reads: [B, S, heads * D]
    present_k: str
    present_v: str
    heads: int
    kv_heads: int
    scale: float


@dataclass
class _GraphParts:
    """A serialized model's graph, read for a rewrite: its nodes, and every other field's bytes as they were."""

    span: tuple[int, int]  # the graph message's payload in the model
    nodes: list
    rest: list  # (field number, value-info name or "", the field's bytes: tag, length and payload)
    inputs: list[str]
    outputs: list[str]
    constants: dict  # small initializers (shapes, scalars): name -> their span

    def graph(self, model) -> "_Graph":
        return _Graph(self.nodes, model, self.constants)


def _read_graph(model) -> _GraphParts | None:
    """The parts of ``model``'s graph, or None when it has none."""
    try:
        g0, g1 = next((lo, hi) for f, w, lo, hi in fields(model, 0, len(model))
                      if f == _MODEL_GRAPH and w == LENGTH_DELIMITED)
    except StopIteration:
        return None
    view = memoryview(model)
    parts = _GraphParts((g0, g1), [], [], [], [], {})
    start = g0  # where the current field's tag starts: fields follow each other
    for f, w, lo, hi in fields(model, g0, g1):
        if f == _GRAPH_NODE and w == LENGTH_DELIMITED:
            parts.nodes.append(_read_node(model, lo, hi))
            start = hi
            continue
        io = f in (_GRAPH_INPUT, _GRAPH_OUTPUT) and w == LENGTH_DELIMITED
        name = _string_field(model, lo, hi, _VALUE_INFO_NAME) if io else ""
        if io:
            (parts.inputs if f == _GRAPH_INPUT else parts.outputs).append(name)
        parts.rest.append((f, name, view[start:hi]))
        if f == _GRAPH_INITIALIZER and w == LENGTH_DELIMITED and hi - lo < 4096:  # shapes, scalars
            parts.constants[_string_field(model, lo, hi, _TENSOR_NAME)] = (lo, hi)
        start = hi
    return parts


def _with_graph(model, span: tuple[int, int], body: bytes) -> bytes:
    """``model`` with its graph's payload (at ``span``) replaced by ``body``, importing mirrorsd's op domain."""
    g0, g1 = span
    view = memoryview(model)
    tag = encode_varint(_MODEL_GRAPH << 3 | LENGTH_DELIMITED)
    graph_start = g0 - len(tag) - len(encode_varint(g1 - g0))  # the graph field's tag and length precede it
    out = b"".join([view[:graph_start], tag, encode_varint(len(body)), body, view[g1:]])
    if DOMAIN not in _opset_domains(out):
        out += _opset_import(DOMAIN, 1)
    return out


def fuse_attention(model: bytes) -> tuple[bytes, int]:
    """``model`` (a serialized ModelProto) with every layer's attention one GroupedAttention node, and how many
    layers changed; (``model``, 0) unchanged when any layer does not have the expected shape."""
    parts = _read_graph(model)
    if parts is None:
        return model, 0
    graph = parts.graph(model)
    try:
        layers = [graph.layer(name) for name in parts.outputs if _is_present_key(name)]
    except (NotThisShape, KeyError, IndexError, ValueError, StopIteration):
        return model, 0
    if not layers:
        return model, 0
    new_nodes = [_Node(_node_bytes(OP_TYPE, [x.q, x.k, x.v, x.cos, x.sin, x.mask, x.past_k, x.past_v],
                                   [x.y, x.present_k, x.present_v], f"{x.present_k}/grouped_attention", DOMAIN,
                                   {"num_heads": x.heads, "kv_num_heads": x.kv_heads}, {"scale": x.scale}),
                       OP_TYPE, DOMAIN, [x.q, x.k, x.v, x.cos, x.sin, x.mask, x.past_k, x.past_v],
                       [x.y, x.present_k, x.present_v]) for x in layers]
    replaced = {name for x in layers for name in (x.y, x.present_k, x.present_v)}
    kept = [n for n in parts.nodes if not any(o in replaced for o in n.output)]
    ordered = _live_in_order(kept + new_nodes, set(parts.outputs))
    body = b"".join(message_field(_GRAPH_NODE, n.raw) for n in ordered)
    body += b"".join(bytes(piece) for _, _, piece in parts.rest)
    return _with_graph(model, parts.span, body), len(layers)


class _Graph:
    def __init__(self, nodes, model, constants) -> None:
        self.producer = {o: n for n in nodes for o in n.output}
        self.consumers = defaultdict(list)
        for n in nodes:
            for name in n.input:
                self.consumers[name].append(n)
        self.model, self.constants = model, constants

    def layer(self, present_k: str) -> Layer:
        present_v = present_k[: -len("key")] + "value"
        concat_k, concat_v = self._node(present_k, "Concat"), self._node(present_v, "Concat")
        past_k, k_rotated = concat_k.input
        past_v, v4 = concat_v.input
        k_heads4, cos, sin = self._rotary(k_rotated)
        k, kv_heads, dim = self._heads(k_heads4)
        v, v_heads, _ = self._heads(v4)
        scores = self._only(present_k, "Transpose")
        matmul = self._only(scores.output[0], "MatMul")
        q_heads4, q_cos, q_sin = self._rotary(self._skip(matmul.input[0], "Reshape"))
        q, heads, q_dim = self._heads(q_heads4)
        if (q_cos, q_sin) != (cos, sin) or v_heads != kv_heads or q_dim != dim or heads % kv_heads:
            raise NotThisShape(present_k)
        scaled = self._after(matmul.output[0], "Mul")
        scale = self._constant(next(i for i in scaled.input if i != self._last_identity(matmul.output[0])))
        masked = self._after(scaled.output[0], "Add")
        mask = self._skip(next(i for i in masked.input if i != scaled.output[0]), "Tile", "Identity", "Expand")
        softmax = self._after(masked.output[0], "Softmax")
        weights = self._skip_forward(softmax.output[0], "Cast")
        weighted = self._only(present_v, "MatMul")
        if self._skip(weighted.input[0], "Cast") != softmax.output[0] or weights not in weighted.input:
            raise NotThisShape(present_k)
        y = weighted.output[0]
        while len(self.consumers[y]) == 1 and self.consumers[y][0].op_type in ("Identity", "Reshape", "Transpose"):
            y = self.consumers[y][0].output[0]
        return Layer(q, k, v, cos, sin, mask, past_k, past_v, y, present_k, present_v, heads, kv_heads,
                     float(scale.reshape(-1)[0]))

    def _node(self, name: str, op_type: str):
        node = self.producer[name]
        if node.op_type != op_type:
            raise NotThisShape(f"{name} comes from {node.op_type}, not {op_type}")
        return node

    def _only(self, name: str, op_type: str):
        found = [n for n in self.consumers[name] if n.op_type == op_type]
        if len(found) != 1:
            raise NotThisShape(f"{name} feeds {len(found)} {op_type} nodes")
        return found[0]

    def _after(self, name: str, op_type: str):
        """The single consumer of ``name`` of ``op_type``, looking through Identity nodes."""
        return self._only(self._last_identity(name), op_type)

    def _last_identity(self, name: str) -> str:
        while len(self.consumers[name]) == 1 and self.consumers[name][0].op_type == "Identity":
            name = self.consumers[name][0].output[0]
        return name

    def _skip(self, name: str, *op_types: str) -> str:
        """Walk up through single-input producers of ``op_types`` (e.g. a Reshape, an Identity)."""
        node = self.producer.get(name)
        while node is not None and node.op_type in op_types:
            name = node.input[0]
            node = self.producer.get(name)
        return name

    def _skip_forward(self, name: str, *op_types: str) -> str:
        while len(self.consumers[name]) == 1 and self.consumers[name][0].op_type in op_types:
            name = self.consumers[name][0].output[0]
        return name

    def _rotary(self, rotated: str) -> tuple[str, str, str]:
        """rotated = x * Unsqueeze(cos) + Concat(Neg(Slice(x)), Slice(x)) * Unsqueeze(sin) -> (x, cos, sin)."""
        add = self._node(rotated, "Add")
        products = [self._node(i, "Mul") for i in add.input]
        halves = [p for p in products if any(self.producer.get(i) is not None and
                                             self.producer[i].op_type == "Concat" for i in p.input)]
        if len(halves) != 1:
            raise NotThisShape(rotated)
        plain = products[1 - products.index(halves[0])]
        concat_input = next(i for i in halves[0].input if self.producer[i].op_type == "Concat")
        sin4 = next(i for i in halves[0].input if i != concat_input)
        x = next(i for i in plain.input if self.producer.get(i) is not None and self.producer[i].op_type == "Transpose")
        cos4 = next(i for i in plain.input if i != x)
        concat = self.producer[concat_input]
        negated = self._node(concat.input[0], "Neg")
        upper, lower = self._node(negated.input[0], "Slice"), self._node(concat.input[1], "Slice")
        if upper.input[0] != x or lower.input[0] != x:
            raise NotThisShape(rotated)
        return x, self._skip(cos4, "Unsqueeze"), self._skip(sin4, "Unsqueeze")

    def _heads(self, heads4: str) -> tuple[str, int, int]:
        """heads4 = Transpose(Reshape(flat, [., ., heads, D])) -> (flat, heads, D)."""
        reshape = self._node(self._node(heads4, "Transpose").input[0], "Reshape")
        shape = self._constant(reshape.input[1]).reshape(-1)
        if len(shape) != 4 or shape[2] < 1 or shape[3] < 1:
            raise NotThisShape(heads4)
        return reshape.input[0], int(shape[2]), int(shape[3])

    def _constant(self, name: str) -> np.ndarray:
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.value is not None:
            return _tensor_values(self.model, *node.value)
        return _tensor_values(self.model, *self.constants[name])


def _is_present_key(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "present" and parts[1].isdigit() and parts[2] == "key"


def _live_in_order(nodes, outputs: set[str]):
    """The nodes some graph output depends on, each after the nodes it reads from (initializers and graph inputs
    are available from the start)."""
    producer = {o: n for n in nodes for o in n.output}
    live, stack = set(), list(outputs)
    while stack:
        node = producer.get(stack.pop())
        if node is None or id(node) in live:
            continue
        live.add(id(node))
        stack.extend(i for i in node.input if i)
    ordered, done, placed = [], set(), set()
    pending = [n for n in nodes if id(n) in live]
    while pending:
        waiting = []
        for node in pending:
            if all(not i or i not in producer or i in done for i in node.input):
                ordered.append(node)
                done.update(node.output)
                placed.add(id(node))
            else:
                waiting.append(node)
        if len(waiting) == len(pending):
            raise MalformedProtobuf("the rewritten graph has a cycle")
        pending = waiting
    return ordered


def _string_field(model, lo: int, hi: int, number: int) -> str:
    for f, w, a, b in fields(model, lo, hi):
        if f == number and w == LENGTH_DELIMITED:
            return bytes(model[a:b]).decode()
    return ""
