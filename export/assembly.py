"""Build a graph layer by layer from traced pieces and the checkpoint's tensors, never holding more than one layer.

    prefix  = stem.ids    + layer 0 .. layer L-1                 hidden of layer L-1 -> hidden_states
    suffix  = stem.hidden + layer L .. layer N-1 + head.logits
    draft   = stem.ids    + layer 0 .. layer K-1 + head.logits
    exit    =                                       head.topk    (hidden_states in)

          input_ids ──► stem ──hidden──► layer 0 ──hidden──► layer 1 ── … ──► head ──► logits
                         │ mask, cos, sin ─┴───────────────────┴── (shared by every layer)
      past_key_values.i.* ─────────────────► layer i ──► present.i.*

Each piece instance gets its own name scope (``/layers.7/...``); its weights are the checkpoint's tensors of that
layer, named after the model parameter (``model.layers.7.mlp.up_proj.weight``, ``....T`` when stored
transposed). With int8/int4 each piece is quantized on its own (the one quantize step of quantize.py) before it
is written: a MatMul's quantization depends on its weight alone, so the result equals quantizing the whole fp32
graph afterwards. With fp16 the pieces are traced in half precision and the graph's float32 inputs and outputs
are cast at its edges. Weights go straight into the external-data file (tensor_file.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirrorsd.export import templates
from mirrorsd.export.graphs.base import LAYER, STEM_IDS, Stack
from mirrorsd.export.graphs.common import GraphIO

STEM_PORTS = ("/stem/hidden", "/stem/mask", "/stem/cos", "/stem/sin")


@dataclass(frozen=True)
class Instance:
    """One piece placed in a graph: its scope, its ports' graph names, and the model path of each of its parts."""

    piece: templates.Piece
    scope: str
    ports: dict[str, str]  # piece input/output name -> graph tensor name
    parts: dict[str, str]  # piece submodule (embed, layer, norm, lm_head) -> dotted model path
    layer: int | None

    def rename(self, name: str) -> str:
        if not name:
            return name
        if name in self.ports:
            return self.ports[name]
        return f"{self.scope}{name}" if name.startswith("/") else f"{self.scope}/{name}"

    def weight_name(self, use: templates.WeightUse) -> str:
        return f"{self.parts[use.part]}.{use.name}" + (".T" if use.transposed else "")

    def weight(self, use: templates.WeightUse, source) -> np.ndarray:
        tensor = source.weights.tensor(f"{self.parts[use.part]}.{use.name}", self.piece.dtype).numpy()
        return np.ascontiguousarray(tensor.T) if use.transposed else tensor

    def nodes(self) -> list:
        renamed = {u.initializer: self.weight_name(u) for u in self.piece.weights}
        out = []
        for node in self.piece.graph.node:
            if any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute):
                raise NotImplementedError(f"{node.op_type} with a subgraph in piece {self.piece.kind}")
            copy = type(node)()
            copy.CopyFrom(node)
            copy.name = self.rename(node.name)
            for field in (copy.input, copy.output):
                for i, name in enumerate(field):
                    field[i] = renamed.get(name) or self.rename(name)
            out.append(copy)
        return out

    def constants(self) -> list:
        out = []
        for tensor in self.piece.graph.initializer:
            copy = type(tensor)()
            copy.CopyFrom(tensor)
            copy.name = self.rename(tensor.name)
            out.append(copy)
        return out

    def value_infos(self, which: str) -> list:
        out = []
        for info in getattr(self.piece.graph, which):
            copy = type(info)()
            copy.CopyFrom(info)
            copy.name = self.rename(info.name)
            out.append(copy)
        return out


def instances(stack: Stack, pieces: dict[str, templates.Piece], arch) -> list[Instance]:
    """The pieces of ``stack`` in graph order, wired to each other and to the graph's inputs and outputs."""
    io, (first, end) = stack.io, stack.layer_range
    graph_in = io.inputs[0].name
    wired = {"attention_mask": io.inputs[1].name, "position_ids": io.inputs[2].name} if len(io.inputs) > 1 else {}
    shared = dict(zip(("mask", "cos", "sin"), STEM_PORTS[1:]))
    out, hidden = [], graph_in
    if stack.stem is not None:
        stem_out = dict(zip(("hidden", "mask", "cos", "sin"), STEM_PORTS))
        out.append(Instance(pieces[stack.stem], "/stem", {"first": graph_in, **wired, **stem_out},
                            {"embed": arch.embed}, None))
        hidden = STEM_PORTS[0] if stack.stem == STEM_IDS else graph_in
    for i in range(first, end):
        last = i == end - 1 and stack.head is None
        ports = {"hidden": hidden, **shared, "past_key": io.kv.past_key % i, "past_value": io.kv.past_value % i,
                 "hidden_out": io.outputs[0].name if last else f"/layers.{i}/hidden",
                 "present_key": io.kv.present_key % i, "present_value": io.kv.present_value % i}
        out.append(Instance(pieces[LAYER], f"/layers.{i}", ports, {"layer": f"{arch.layers}.{i}"}, i))
        hidden = ports["hidden_out"]
    if stack.head is not None:
        names = pieces[stack.head].outputs
        ports = {"hidden": hidden, **{n: t.name for n, t in zip(names, io.outputs)}}
        out.append(Instance(pieces[stack.head], "/head", ports,
                            {"norm": arch.final_norm, "lm_head": arch.lm_head}, None))
    return out


def cast_boundaries(placed: list[Instance], io: GraphIO) -> tuple[list[Instance], list, list]:
    """Casts where a piece's port has another type than the graph's input or output it is wired to (float16
    pieces behind the float32 contract of docs/graphs.md); the instances rewired to the cast side."""
    import dataclasses

    from onnx import helper

    from mirrorsd.export.tensor_file import onnx_dtypes

    contract = {t.name: onnx_dtypes()[t.dtype] for t in (*io.inputs, *io.outputs)}
    inputs = {t.name for t in io.inputs}
    casts, rewired = {}, []
    for instance in placed:
        ports = dict(instance.ports)
        for info in (*instance.piece.graph.input, *instance.piece.graph.output):
            name, kind = ports.get(info.name), info.type.tensor_type.elem_type
            if name not in contract or kind == contract[name]:
                continue
            ports[info.name] = inner = f"{name}/as_piece_type"
            casts[name] = helper.make_node("Cast", [name], [inner], name=f"/cast_in/{name}", to=kind) \
                if name in inputs else helper.make_node("Cast", [inner], [name], name=f"/cast_out/{name}",
                                                        to=contract[name])
        rewired.append(dataclasses.replace(instance, ports=ports))
    cast_in = [casts[n] for n in casts if n in inputs]
    return rewired, cast_in, [casts[n] for n in casts if n not in inputs]


def piece_model(instance: Instance, source, opset_import, ir_version: int, inline_matmul_weights: bool):
    """One piece instance as a model of its own, and the weights it leaves out as ``{name: array}``.

    Left-out weights appear as external stubs, to be supplied at session creation or written to a file as they
    are. ``inline_matmul_weights`` puts the MatMul weights and the token embedding into the model instead: the
    quantizer reads them there."""
    from onnx import helper, numpy_helper

    from mirrorsd.export.embedding import embedding_names

    nodes = instance.nodes()
    matmul_b = {n.input[1] for n in nodes if n.op_type == "MatMul"} | \
        {n.input[0] for n in nodes if n.op_type == "Gather" and n.input[0] in embedding_names()} \
        if inline_matmul_weights else set()
    weights = {instance.weight_name(u): instance.weight(u, source) for u in instance.piece.weights}
    stored = [numpy_helper.from_array(weights.pop(name), name) if name in matmul_b else _stub(name, weights[name])
              for name in list(weights)]
    graph = helper.make_graph(nodes, instance.scope, instance.value_infos("input"),
                              instance.value_infos("output"), instance.constants() + stored)
    model = helper.make_model(graph, opset_imports=list(opset_import))
    model.ir_version = ir_version
    return model, weights


def _stub(name: str, array: np.ndarray):
    from onnx import TensorProto, helper

    tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "supplied-at-session-creation"), ("offset", "0"), ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def write_stack(stack: Stack, pieces: dict, source, path: Path, precision: str, model_kind: str,
                on_piece: Callable[[int, int], None] = lambda done, total: None, blocks=None,
                embedding=None) -> Path:
    """Write ``path`` (+ ``path.data`` when it passes 2 GB) piece by piece; ``on_piece(done, total)`` after each.
    ``blocks``: a gguf_blocks.BlockPlan (GGUF blocks carried where they map exactly), or None; ``embedding``: an
    embedding.EmbeddingPlan (None: quantized, over ``blocks``)."""
    from onnx import helper

    from mirrorsd.export.graphs.attention import KIND
    from mirrorsd.export.quantize import QUANTIZED, quantize_model
    from mirrorsd.export.tensor_file import TensorFile

    placed, cast_in, cast_out = cast_boundaries(instances(stack, pieces, source.arch), stack.io)
    template = next(iter(pieces.values()))
    opset, ir_version = list(template.opset_import), template.ir_version
    nodes, initializers = [], []
    with TensorFile(path) as data:
        for done, instance in enumerate(placed, 1):
            model, rest = piece_model(instance, source, opset, ir_version, precision in QUANTIZED)
            if precision in QUANTIZED:
                model = quantize_model(model, precision, model_kind, KIND, blocks, path.stem, embedding=embedding)
            # copies, not references: a sub-message keeps its whole model (this piece's weights) alive
            initializers += [_detached(data.add_proto(t)) for t in model.graph.initializer if not t.external_data]
            initializers += [data.add(name, rest.pop(name)) for name in list(rest)]
            nodes += [_detached(n) for n in model.graph.node]
            opset = _merge_opsets(opset, [_detached(o) for o in model.opset_import])
            del model
            on_piece(done, len(placed))
        graph = helper.make_graph(cast_in + nodes + cast_out, path.stem, [_value_info(t) for t in stack.io.inputs],
                                  [_value_info(t) for t in stack.io.outputs], initializers)
        data.finish(helper.make_model(graph, opset_imports=opset, producer_name="mirrorsd", ir_version=ir_version))
    return path


def _detached(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def _merge_opsets(opset: list, more) -> list:
    domains = {o.domain: o for o in opset}
    for o in more:
        domains.setdefault(o.domain, o)
    return list(domains.values())


def _value_info(spec):
    from onnx import helper

    from mirrorsd.export.tensor_file import onnx_dtypes

    return helper.make_tensor_value_info(spec.name, onnx_dtypes()[spec.dtype], list(spec.shape))
