"""Rewrite an exported target graph so that its KV cache is written in place instead of copied every step.

An exported layer keeps its cache as ONNX Runtime's outputs: ``present = Concat(past, new)``, fed back as the next
``past``. The Concat reads and writes the whole cache on every call, so a decoding step's cost grows with the
context far faster than the attention's own read of it (at 4096 cached tokens the Concats took 22 of a 106 ms step
on a 2-core AMD EPYC; docs/bench/zen3-2026-12-07/long-context.md has the rest).

``kv_in_place`` changes each layer (the traced eager attention that attention_rewrite.py also reads) so that:

    past_k, past_v inputs          -> one view input per KV head and kind: ``kv_view.L.key.H``, [B, 1, P + S, D],
                                      the host's buffer for that head, spanning the past and this call's new slots
    Concat(past, new) -> present   -> KVWrite(x, new, view; head=H) (src/kv_write.cpp) fills the new slots in place
    softmax(q @ present_k^T * scale + mask) @ present_v
                                   -> the same nodes per KV head (a Split of q along the head axis, the scale, mask,
                                      softmax and casts copied per head, a Concat of the heads' results), reading
                                      the views: nothing of the size of the scores is split or joined
    present outputs                -> gone (the host's buffers are the cache: runtime/view_cache.py)

The KVWrite chain passes the queries through, so each head's MatMul runs after every view holds its new slots. The
rows are copies and the scores the same bits, but ONNX Runtime blocks one head's probabilities x values product
differently from the graph's two-head product once the context passes 128 slots with two threads, and differently
again for windows with more query rows than the head has columns: not exact yet, so the runtime leaves it off
(devices/kernels/README.md; tests/test_kv_in_place.py checks the logits bit for bit on short contexts). A graph whose
attention does not have this shape is left as it is (0 layers). The session must register mirrorsd's library.
"""
from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.devices.kernels.attention_rewrite import (_GRAPH_INITIALIZER, _GRAPH_NODE, _GRAPH_OUTPUT, _MODEL_GRAPH,
                                                        _NODE_ATTRIBUTE, _TENSOR_NAME, _VALUE_INFO_NAME,
                                                        NotThisShape, _Graph, _is_present_key,
                                                        _live_in_order, _Node, _node_bytes, _read_node,
                                                        _string_field)
from mirrorsd.devices.kernels.rewrite import DOMAIN, _opset_domains, _opset_import
from mirrorsd.onnx_wire import (LENGTH_DELIMITED, MalformedProtobuf, encode_varint, fields, message_field,
                                varint_field)

OP_TYPE = "KVWrite"
_GRAPH_INPUT = 11
_ATTRIBUTE_NAME, _ATTRIBUTE_INTS, _ATTRIBUTE_TYPE, _INTS_ATTRIBUTE = 1, 8, 20, 7
_INT_ATTRIBUTE, _ATTRIBUTE_INT = 2, 3
_VALUE_INFO_TYPE, _TYPE_TENSOR, _TENSOR_ELEM_TYPE, _TENSOR_SHAPE, _SHAPE_DIM = 2, 1, 1, 2, 1
_DIM_VALUE, _DIM_PARAM = 1, 2
_FLOAT = 1
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME = 1, 2, 3
_CHAIN_OPS = ("Identity", "Mul", "Add", "Softmax", "Cast")  # between the two attention MatMuls, as traced


def view_name(layer: int, kind: str, head: int) -> str:
    """The input that carries KV head ``head``'s ``kind`` ("key" or "value") cache of layer ``layer``."""
    return f"kv_view.{layer}.{kind}.{head}"


@dataclass(frozen=True)
class InPlaceLayer:
    """One rewritten layer: its number, KV heads and head size, and the past/present names it replaced."""

    layer: int
    kv_heads: int
    head_dim: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str

    def views(self, kind: str) -> list[str]:
        return [view_name(self.layer, kind, h) for h in range(self.kv_heads)]


def kv_in_place(model: bytes) -> tuple[bytes, list[InPlaceLayer]]:
    """``model`` (a serialized ModelProto) with every layer's KV cache written in place, and the layers changed;
    (``model``, []) unchanged when any layer does not have the expected shape."""
    try:
        g0, g1 = next((lo, hi) for f, w, lo, hi in fields(model, 0, len(model))
                      if f == _MODEL_GRAPH and w == LENGTH_DELIMITED)
    except StopIteration:
        return model, []
    view = memoryview(model)
    nodes, rest, inputs, outputs, constants = [], [], [], [], {}
    start = g0
    for f, w, lo, hi in fields(model, g0, g1):
        if f == _GRAPH_NODE and w == LENGTH_DELIMITED:
            nodes.append(_read_node(model, lo, hi))
        else:
            io = f in (_GRAPH_INPUT, _GRAPH_OUTPUT) and w == LENGTH_DELIMITED
            name = _string_field(model, lo, hi, _VALUE_INFO_NAME) if io else ""
            if f == _GRAPH_INPUT and w == LENGTH_DELIMITED:
                inputs.append(name)
            if f == _GRAPH_OUTPUT and w == LENGTH_DELIMITED:
                outputs.append(name)
            rest.append((f, name, view[start:hi]))
            if f == _GRAPH_INITIALIZER and w == LENGTH_DELIMITED and hi - lo < 4096:  # shapes, scalars
                constants[_string_field(model, lo, hi, _TENSOR_NAME)] = (lo, hi)
        start = hi
    graph = _Graph(nodes, model, constants)
    try:
        found = [_find(graph, name, set(inputs)) for name in outputs if _is_present_key(name)]
    except (NotThisShape, KeyError, IndexError, ValueError, StopIteration):
        return model, []
    if not found:
        return model, []
    removed, new_nodes = set(), []
    for layer, parts in found:
        removed.update(id(n) for n in parts["drop"])
        new_nodes += _layer_nodes(layer, parts)
    dropped_io = {n for layer, _ in found for n in (layer.past_key, layer.past_value, layer.present_key,
                                                    layer.present_value)}
    kept = [n for n in nodes if id(n) not in removed]
    ordered = _live_in_order(kept + new_nodes, set(outputs) - dropped_io)
    pieces = [message_field(_GRAPH_NODE, n.raw) for n in ordered]
    pieces += [bytes(piece) for f, name, piece in rest if not (f in (_GRAPH_INPUT, _GRAPH_OUTPUT) and name in dropped_io)]
    pieces += [message_field(_GRAPH_INPUT, _view_info(name, layer.head_dim))
               for layer, _ in found for kind in ("key", "value") for name in layer.views(kind)]
    body = b"".join(pieces)
    tag = encode_varint(_MODEL_GRAPH << 3 | LENGTH_DELIMITED)
    graph_start = g0 - len(tag) - len(encode_varint(g1 - g0))
    out = b"".join([view[:graph_start], tag, encode_varint(len(body)), body, view[g1:]])
    if DOMAIN not in _opset_domains(out):
        out += _opset_import(DOMAIN, 1)
    return out, [layer for layer, _ in found]


def _find(graph: _Graph, present_k: str, graph_inputs: set[str]) -> tuple[InPlaceLayer, dict]:
    """The nodes of one layer's cache and attention products, checked to be read by nothing else."""
    shape = graph.layer(present_k)  # the traced eager attention, or NotThisShape
    present_v = shape.present_v
    concat_k, concat_v = graph._node(present_k, "Concat"), graph._node(present_v, "Concat")
    if concat_k.input[0] not in graph_inputs or concat_v.input[0] not in graph_inputs:
        raise NotThisShape(present_k)
    transpose = graph._only(present_k, "Transpose")
    scores = graph._only(transpose.output[0], "MatMul")
    weighted = graph._only(present_v, "MatMul")
    if (len(graph.consumers[present_k]) != 1 or len(graph.consumers[present_v]) != 1
            or len(graph.consumers[transpose.output[0]]) != 1 or weighted.input[1] != present_v
            or scores.input[1] != transpose.output[0]):
        raise NotThisShape(present_k)
    chain, name = [], scores.output[0]  # scores -> (Identity) Mul Add Softmax (Cast) -> probabilities
    while name != weighted.input[0]:
        after = graph.consumers[name]
        if len(after) != 1 or after[0].op_type not in _CHAIN_OPS or len(after[0].output) != 1:
            raise NotThisShape(present_k)
        if after[0].op_type == "Add":  # the mask must broadcast over the KV heads: [B, 1, G * S, T]
            mask = next(i for i in after[0].input if i != name)
            tile = graph._node(mask, "Tile")
            if graph._constant(tile.input[1]).reshape(-1)[1] != 1:
                raise NotThisShape(present_k)
        chain.append(after[0])
        name = after[0].output[0]
    head_dim = _layer_head_dim(graph, shape)
    layer = InPlaceLayer(int(present_k.split(".")[1]), shape.kv_heads, head_dim, shape.past_k, shape.past_v,
                         present_k, present_v)
    return layer, {"drop": [concat_k, concat_v, transpose, scores, weighted, *chain], "chain": chain,
                   "scores": scores.output[0], "k_new": concat_k.input[1], "v_new": concat_v.input[1],
                   "queries": scores.input[0], "context": weighted.output[0]}


def _layer_head_dim(graph: _Graph, shape) -> int:
    _, _, dim = graph._heads(graph._node(shape.present_v, "Concat").input[1])  # v4 = Transpose(Reshape(v))
    return dim


def _layer_nodes(layer: InPlaceLayer, parts: dict) -> list[_Node]:
    prefix = f"{layer.present_key}/in_place"
    made: list[_Node] = []

    def add(op_type, inputs, outputs, domain="", ints=None, lists=None):
        raw = _node_bytes(op_type, inputs, outputs, f"{prefix}/{op_type}_{len(made)}", domain, ints or {}, {})
        for key, values in (lists or {}).items():
            raw += message_field(_NODE_ATTRIBUTE, message_field(_ATTRIBUTE_NAME, key.encode()) + b"".join(
                varint_field(_ATTRIBUTE_INTS, v) for v in values) + varint_field(_ATTRIBUTE_TYPE, _INTS_ATTRIBUTE))
        made.append(_Node(raw, op_type, domain, list(inputs), list(outputs)))

    x = parts["queries"]  # [B, KVH, G * S, D]
    for kind, new in (("key", parts["k_new"]), ("value", parts["v_new"])):
        for h, name in enumerate(layer.views(kind)):
            written = f"{prefix}/written_{kind}{h}"
            add(OP_TYPE, [x, new, name], [written], DOMAIN, ints={"head": h})
            x = written
    heads = range(layer.kv_heads)
    queries = [f"{prefix}/q{h}" for h in heads]  # [B, 1, G * S, D]
    add("Split", [x], queries, ints={"axis": 1})
    contexts = []
    for h, (key, value) in enumerate(zip(layer.views("key"), layer.views("value"))):
        keys_t = f"{prefix}/keys_t{h}"  # [B, 1, D, T]
        add("Transpose", [key], [keys_t], lists={"perm": [0, 1, 3, 2]})
        name = f"{prefix}/scores{h}"  # [B, 1, G * S, T]
        add("MatMul", [queries[h], keys_t], [name])
        previous = parts["scores"]
        for i, node in enumerate(parts["chain"]):  # scale, mask, softmax, casts: this head's rows only
            inputs = [name if x == previous else x for x in node.input]  # the mask [B, 1, G * S, T] broadcasts
            previous, name = node.output[0], f"{prefix}/head{h}_{i}_{node.op_type}"
            made.append(_Node(_renamed(node.raw, inputs, [name], f"{prefix}/{name}"), node.op_type, node.domain,
                              inputs, [name]))
        contexts.append(f"{prefix}/context{h}")  # [B, 1, G * S, D]
        add("MatMul", [name, value], [contexts[-1]])
    add("Concat", contexts, [parts["context"]], ints={"axis": 1})
    return made


def _renamed(raw: bytes, inputs: list[str], outputs: list[str], name: str) -> bytes:
    """A NodeProto's bytes with new inputs, outputs and name; its op type, domain and attributes as they were."""
    kept = b"".join(bytes(raw[start:hi]) for f, start, hi in _field_spans(raw)
                    if f not in (_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME))
    return (b"".join(message_field(_NODE_INPUT, i.encode()) for i in inputs)
            + b"".join(message_field(_NODE_OUTPUT, o.encode()) for o in outputs)
            + message_field(_NODE_NAME, name.encode()) + kept)


def _field_spans(raw: bytes):
    """(field number, start of its tag, end of its payload) of each top-level field of a message."""
    start = 0
    for f, _, _, hi in fields(raw, 0, len(raw)):
        yield f, start, hi
        start = hi


def _view_info(name: str, head_dim: int) -> bytes:
    """ValueInfoProto of a view input: float [batch, 1, kv_total, head_dim]."""
    dims = [message_field(_DIM_PARAM, b"batch_size"), varint_field(_DIM_VALUE, 1),
            message_field(_DIM_PARAM, b"kv_total_length"), varint_field(_DIM_VALUE, head_dim)]
    shape = b"".join(message_field(_SHAPE_DIM, d) for d in dims)
    tensor = varint_field(_TENSOR_ELEM_TYPE, _FLOAT) + message_field(_TENSOR_SHAPE, shape)
    return message_field(_VALUE_INFO_NAME, name.encode()) + message_field(_VALUE_INFO_TYPE,
                                                                          message_field(_TYPE_TENSOR, tensor))


__all__ = ["InPlaceLayer", "MalformedProtobuf", "kv_in_place", "view_name"]
