"""The exit head's ONNX graph, cut and extended where its LM head starts (whatever the norm and the precision).

    exit_head.onnx (export):   hidden_states -> [final norm] -> x -> [LM head] -> logits -> log_softmax -> top-k
    trunk(model)               hidden_states -> x                     the adapter's training features
    head_only(model)           x -> logits                            read back W and b by feeding I and 0
    with_adapter(model, ...)   ... -> x -> x + (x @ down) @ up -> [LM head] -> ...   (the trained exit head)
    sparse_head(model, ...)    hidden_states, candidate_ids [B, S, m] -> candidate_logits [B, S, m]
                               = x' . W[:, id] + b[id]: m gathered LM-head rows instead of the whole vocabulary

The LM head is found as the last node before the LogSoftmax that reads a weight of the vocabulary's width
(MatMul, or MatMulNBits for int8/int4 heads); its input x is the cut point.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mirrorsd import names
from mirrorsd.errors import UnsupportedArchitectureError

FEATURES = "exit_features"  # trunk output: the LM head's input x [B, S, H]
HEAD_INPUT = "exit_head_input"  # head_only input
CANDIDATE_IDS, CANDIDATE_LOGITS = names.CANDIDATE_IDS, names.CANDIDATE_LOGITS  # sparse head in [B, S, m] / out
CANDIDATES = "candidates"  # the sparse head's candidate axis (dynamic)
ADAPTER_DOWN, ADAPTER_UP = "exit_adapter.down", "exit_adapter.up"


def _producers(graph) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def logits_tensor(model: onnx.ModelProto) -> str:
    """The tensor the LogSoftmax reads: the exit head's logits."""
    for node in model.graph.node:
        if node.op_type == "LogSoftmax":
            return node.input[0]
    raise UnsupportedArchitectureError("The exit head has no LogSoftmax", "it is not a mirrorsd exit head graph",
                                       "re-export the folder with this version of mirrorsd-export")


def lm_head(model: onnx.ModelProto) -> onnx.NodeProto:
    """The LM-head node: the MatMul/MatMulNBits nearest to the logits (walking back from them)."""
    produced = _producers(model.graph)
    tensor = logits_tensor(model)
    while tensor in produced:
        node = produced[tensor]
        if node.op_type in ("MatMul", "MatMulNBits"):
            return node
        tensor = node.input[0]
    raise UnsupportedArchitectureError("The exit head's LM head was not found", "no MatMul feeds its logits",
                                       "re-export the folder with this version of mirrorsd-export")


def _subgraph(model: onnx.ModelProto, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              extra_nodes=(), extra_initializers=()) -> onnx.ModelProto:
    """The nodes (and initializers) of ``model`` needed for ``outputs`` from ``inputs``, plus the extras."""
    graph = model.graph
    nodes = list(graph.node) + list(extra_nodes)
    produced = {out: node for node in nodes for out in node.output}
    stop = {i.name for i in inputs}
    keep, todo, seen = [], [o.name for o in outputs], set()
    while todo:
        tensor = todo.pop()
        if tensor in seen or tensor in stop or tensor not in produced:
            continue
        seen.add(tensor)
        node = produced[tensor]
        if node not in keep:
            keep.append(node)
            todo += [t for t in node.input if t]
    keep.sort(key=nodes.index)  # topological order as in the source
    used = {t for n in keep for t in n.input}
    inits = [t for t in list(graph.initializer) + list(extra_initializers) if t.name in used]
    new = helper.make_graph(keep, "exit", inputs, outputs, inits)
    out = helper.make_model(new, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out


def _float_info(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _hidden_input(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    return model.graph.input[0]


def trunk(model: onnx.ModelProto) -> onnx.ModelProto:
    """hidden_states -> x (the LM head's input), named FEATURES."""
    x = lm_head(model).input[0]
    ident = helper.make_node("Identity", [x], [FEATURES], name="exit_features")
    return _subgraph(model, [_hidden_input(model)], [_float_info(FEATURES, None)], [ident])


def head_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """x -> logits: the LM head as the exit graph computes it (quantized or not)."""
    node = lm_head(model)
    x = node.input[0]
    logits = logits_tensor(model)
    rename = helper.make_node("Identity", [HEAD_INPUT], [x], name="exit_head_input")
    sub = _subgraph(model, [_float_info(x, None)], [_float_info(logits, None)])
    sub.graph.input[0].name = HEAD_INPUT
    sub.graph.node.insert(0, rename)
    return sub


def head_weight(model: onnx.ModelProto, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """(W [H, V], b [V]) float32 of the exit head's LM head, read back through ONNX Runtime by feeding the unit
    rows and a zero row (a quantized head gives its dequantized weights: a unit row is exact in int8)."""
    import onnxruntime as ort

    session = ort.InferenceSession(head_only(model).SerializeToString(), providers=["CPUExecutionProvider"])
    probe = np.concatenate([np.eye(hidden, dtype=np.float32), np.zeros((1, hidden), np.float32)])[None]
    logits = session.run(None, {HEAD_INPUT: probe})[0][0].astype(np.float32)  # [H + 1, V]
    bias = logits[hidden]
    return logits[:hidden] - bias, bias


def with_adapter(model: onnx.ModelProto, down: np.ndarray, up: np.ndarray) -> onnx.ModelProto:
    """A copy of ``model`` with x -> x + (x @ down) @ up inserted before its LM head."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = lm_head(out)
    x = node.input[0]
    adapted = "exit_adapter.output"
    new_nodes = [
        helper.make_node("MatMul", [x, ADAPTER_DOWN], ["exit_adapter.low"], name="exit_adapter/down"),
        helper.make_node("MatMul", ["exit_adapter.low", ADAPTER_UP], ["exit_adapter.delta"], name="exit_adapter/up"),
        helper.make_node("Add", [x, "exit_adapter.delta"], [adapted], name="exit_adapter/add"),
    ]
    node.input[0] = adapted
    at = list(out.graph.node).index(node)
    for i, n in enumerate(new_nodes):
        out.graph.node.insert(at + i, n)
    out.graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(down, np.float32), ADAPTER_DOWN),
                                  numpy_helper.from_array(np.ascontiguousarray(up, np.float32), ADAPTER_UP)])
    return out


def sparse_head(model: onnx.ModelProto, weight: np.ndarray, bias: np.ndarray, rows_dtype=np.float32
                ) -> onnx.ModelProto:
    """hidden_states, candidate_ids [B, S, m] -> candidate_logits [B, S, m] from ``model`` (an exit head, with its
    adapter if it has one) and its LM head read back as (W [H, V], b [V]); the rows are stored as ``rows_dtype``."""
    x = lm_head(model).input[0]  # the adapted x when the model has an adapter
    rows = np.ascontiguousarray(weight.T, rows_dtype)  # [V, H]
    inits = [numpy_helper.from_array(rows, "exit_sparse.rows"),
             numpy_helper.from_array(np.array([-1], np.int64), "exit_sparse.last_axis"),
             numpy_helper.from_array(np.array([2], np.int64), "exit_sparse.candidate_axis")]
    nodes = [helper.make_node("Gather", ["exit_sparse.rows", CANDIDATE_IDS], ["exit_sparse.gathered"], axis=0)]
    gathered = "exit_sparse.gathered"
    if rows_dtype != np.float32:
        nodes.append(helper.make_node("Cast", [gathered], ["exit_sparse.gathered32"], to=TensorProto.FLOAT))
        gathered = "exit_sparse.gathered32"
    nodes += [  # [B, S, m, H] . [B, S, 1, H] summed over H
        helper.make_node("Unsqueeze", [x, "exit_sparse.candidate_axis"], ["exit_sparse.x"]),
        helper.make_node("Mul", [gathered, "exit_sparse.x"], ["exit_sparse.products"]),
        helper.make_node("ReduceSum", ["exit_sparse.products", "exit_sparse.last_axis"],
                         ["exit_sparse.dots" if np.any(bias) else CANDIDATE_LOGITS], keepdims=0),
    ]
    if np.any(bias):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(bias, np.float32), "exit_sparse.bias"))
        nodes += [helper.make_node("Gather", ["exit_sparse.bias", CANDIDATE_IDS], ["exit_sparse.bias_at"], axis=0),
                  helper.make_node("Add", ["exit_sparse.dots", "exit_sparse.bias_at"], [CANDIDATE_LOGITS])]
    ids = helper.make_tensor_value_info(CANDIDATE_IDS, TensorProto.INT64, [names.BATCH, names.SEQUENCE, CANDIDATES])
    out = _float_info(CANDIDATE_LOGITS, [names.BATCH, names.SEQUENCE, CANDIDATES])
    return _subgraph(model, [_hidden_input(model), ids], [out], nodes, inits)
