"""Rewrite an exported target graph so that its KV cache is written in place instead of copied every step.

An exported layer keeps its cache as ONNX Runtime's outputs: ``present = Concat(past, new)``, fed back as the next
``past``. The Concat reads and writes the whole cache on every call, so a decoding step's cost grows with the
context far faster than the attention's own read of it (at 4096 cached tokens the Concats took 22 of a 106 ms step
on a 2-core AMD EPYC; docs/bench/zen3-2026-12-07/long-context.md has the rest).

``kv_in_place`` changes each layer (the traced eager attention that attention_rewrite.py also reads) so that:

    past_k, past_v inputs          -> one view input per KV head and kind: ``kv_view.L.key.H``, [B, 1, P + S, D],
                                      the host's buffer for that head, spanning the past and this call's new slots
    rotary, Concat(past, new), softmax(q @ present_k^T * scale + mask) @ present_v, the head reshapes
                                   -> one InPlaceAttention node (src/attention.cpp): it writes the new keys (rotated)
                                      and values into the views and computes each query row alone, in a fixed order
    present outputs                -> gone (the host's buffers are the cache: runtime/view_cache.py)

The node computes what the exported nodes compute, rounded its own way (its own exp, its own summation order), and
each row's bits do not depend on the window it is in or on the thread count: one-row decoding and a verification
window agree bit for bit at any context, which ONNX Runtime's MatMul does not promise for these products (it blocks
their reduction by its thread split and row count). A graph whose attention does not have this shape is left as it
is (0 layers). The session must register mirrorsd's library.
"""
from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.devices.kernels.attention_rewrite import (_GRAPH_INPUT, _GRAPH_NODE, _GRAPH_OUTPUT, _VALUE_INFO_NAME,
                                                        Layer, NotThisShape, _Graph, _is_present_key, _live_in_order,
                                                        _Node, _node_bytes, _read_graph, _with_graph)
from mirrorsd.devices.kernels.rewrite import DOMAIN
from mirrorsd.onnx_wire import MalformedProtobuf, message_field, varint_field

OP_TYPE = "InPlaceAttention"
_VALUE_INFO_TYPE, _TYPE_TENSOR, _TENSOR_ELEM_TYPE, _TENSOR_SHAPE, _SHAPE_DIM = 2, 1, 1, 2, 1
_DIM_VALUE, _DIM_PARAM = 1, 2
_FLOAT = 1


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
    parts = _read_graph(model)
    if parts is None:
        return model, []
    graph = parts.graph(model)
    try:
        found = [_find(graph, name, set(parts.inputs)) for name in parts.outputs if _is_present_key(name)]
    except (NotThisShape, KeyError, IndexError, ValueError, StopIteration):
        return model, []
    if not found:
        return model, []
    new_nodes = [_attention_node(layer, shape) for layer, shape in found]
    replaced = {name for _, x in found for name in (x.y, x.present_k, x.present_v)}
    dropped_io = {n for layer, _ in found for n in (layer.past_key, layer.past_value, layer.present_key,
                                                    layer.present_value)}
    kept = [n for n in parts.nodes if not any(o in replaced for o in n.output)]
    ordered = _live_in_order(kept + new_nodes, set(parts.outputs) - dropped_io)
    pieces = [message_field(_GRAPH_NODE, n.raw) for n in ordered]
    pieces += [bytes(piece) for f, name, piece in parts.rest
               if not (f in (_GRAPH_INPUT, _GRAPH_OUTPUT) and name in dropped_io)]
    pieces += [message_field(_GRAPH_INPUT, _view_info(name, layer.head_dim))
               for layer, _ in found for kind in ("key", "value") for name in layer.views(kind)]
    return _with_graph(model, parts.span, b"".join(pieces)), [layer for layer, _ in found]


def _find(graph: _Graph, present_k: str, graph_inputs: set[str]) -> tuple[InPlaceLayer, Layer]:
    """One layer's attention (the tensors the fused node reads and writes), its cache fed from graph inputs."""
    shape = graph.layer(present_k)  # the traced eager attention, or NotThisShape
    if shape.past_k not in graph_inputs or shape.past_v not in graph_inputs:
        raise NotThisShape(present_k)
    _, _, head_dim = graph._heads(graph._node(shape.present_v, "Concat").input[1])  # v4 = Transpose(Reshape(v))
    layer = InPlaceLayer(int(present_k.split(".")[1]), shape.kv_heads, head_dim, shape.past_k, shape.past_v,
                         present_k, shape.present_v)
    return layer, shape


def _attention_node(layer: InPlaceLayer, x: Layer) -> _Node:
    inputs = [x.q, x.k, x.v, x.cos, x.sin, x.mask, *layer.views("key"), *layer.views("value")]
    raw = _node_bytes(OP_TYPE, inputs, [x.y], f"{x.present_k}/in_place_attention", DOMAIN,
                      {"num_heads": x.heads, "kv_num_heads": x.kv_heads}, {"scale": x.scale})
    return _Node(raw, OP_TYPE, DOMAIN, inputs, [x.y])


def _view_info(name: str, head_dim: int) -> bytes:
    """ValueInfoProto of a view input: float [batch, 1, kv_total, head_dim]."""
    dims = [message_field(_DIM_PARAM, b"batch_size"), varint_field(_DIM_VALUE, 1),
            message_field(_DIM_PARAM, b"kv_total_length"), varint_field(_DIM_VALUE, head_dim)]
    shape = b"".join(message_field(_SHAPE_DIM, d) for d in dims)
    tensor = varint_field(_TENSOR_ELEM_TYPE, _FLOAT) + message_field(_TENSOR_SHAPE, shape)
    return message_field(_VALUE_INFO_NAME, name.encode()) + message_field(_VALUE_INFO_TYPE,
                                                                          message_field(_TYPE_TENSOR, tensor))


__all__ = ["InPlaceLayer", "MalformedProtobuf", "kv_in_place", "view_name"]
