"""Load-time rewrites of an ONNX graph read by OpenVINO. The graph's inputs and outputs stay as docs/graphs.md says
(a stateful model only hides its KV pairs inside the session); what changes is how OpenVINO's CPU plugin computes.

Three rewrites, each measured by scripts/lab/openvino_target.py (numbers in docs/lab-notes/performance-log.md):

fused_attention     the attention subgraph (grouped, export/graphs/attention.py, in either of its two traced forms, or
                    transformers' eager one)
                    -> one ScaledDotProductAttention op, which the plugin runs as its own attention kernel
make_stateful       past_key_values.* / present.* pairs -> state variables; with fused attention the plugin keeps
                    the cache inside its attention node (no KV crosses the API per step)
row_invariant_softmax
                    Softmax -> max, exp, a MatMul with ones for the sum, divide (for graphs that keep explicit KV)

Batch invariance (docs/algorithm.md, "Batch invariance"): a verification window of S rows attends to T = P + S key
slots where one-row decoding attends to P + 1; the extra slots are masked and sit after the row's own. The plugin's
Softmax sums a row in an order that depends on T (a rounding-level change), and int8 dynamic quantization of the
next MatMul's input amplifies that to a visible logit difference. Its MatMul
(brgemm) accumulates K in index order, so trailing zeros add nothing: the decomposed softmax gives the same bits for
T and T + pad. Its stateful attention kernel computes each query row alone over that row's own slots: bitwise
invariant with an f32, f16 or bf16 cache (not u8: see OpenVINOSession.trim_state).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PASS_THROUGH = ("Convert", "Slice", "Identity")  # f32 -> f32 casts, the row/slot trims between the attention's ops
# (Identity where export/shape_constants.py found a trim that keeps the whole axis)
BEAM_INPUT = "beam_idx"  # [B] int32, fed 0..B-1: the plugin's stateful attention fusion requires a beam reorder


def _producer(output, type_name: str):
    """The node of type ``type_name`` that makes ``output``, looking through casts and slices; else None."""
    node = output.get_node()
    while node.get_type_name() in PASS_THROUGH:
        node = node.input_value(0).get_node()
    return node if node.get_type_name() == type_name else None


def _consumer(node, type_name: str):
    """The only node of type ``type_name`` that reads ``node``, looking through casts and slices; else None."""
    while True:
        readers = list(node.output(0).get_target_inputs()) if node.get_output_size() == 1 else []
        if len(readers) != 1:
            return None
        node = readers[0].get_node()
        if node.get_type_name() not in PASS_THROUGH:
            return node if node.get_type_name() == type_name else None


@dataclass
class Attention:
    """One attention subgraph, as the ScaledDotProductAttention op will take it."""

    query: object  # [B, H, S, D]
    key: object  # [B, h, T, D] (grouped: the cache itself) or [B, H, T, D] (eager: already repeated to H heads)
    value: object
    mask: object  # additive, [B, 1, S, T] ([B, 1, 1, S, T] where ``five_d_mask``)
    scale: float
    out: object  # the output that the fused op replaces, [B, H, S, D]
    grouped: bool
    five_d_mask: bool = False  # grouped, as traced before the mask was tiled: [B, 1, 1, S, T]


def find_attention(softmax) -> Attention | None:
    """The attention around ``softmax``, or None when it is neither pattern:

        grouped: q -Reshape-> [B, h, G*S, D] -MatMul(k^T)-> -Mul(scale)-Add(Tile(mask [B, 1, S, T]))->
                 Softmax -MatMul(v [B, h, T, D])-> -Reshape-> out [B, H, S, D]
        grouped, exports before the tiled mask:
                 q -Reshape-> [B, h, G*S, D] -MatMul(k^T)-> -Reshape-> [B, h, G, S, T] -Mul(scale)-Add(mask)->
                 Softmax -Reshape-> [B, h, G*S, T] -MatMul(v [B, h, T, D])-> -Reshape-> out [B, H, S, D]
        eager:   q -MatMul(k_rep^T)-Mul(scale)-Add(mask)-> Softmax -MatMul(v_rep)-> out [B, H, S, D]
    """
    add = _producer(softmax.input_value(0), "Add")
    mul = add and _producer(add.input_value(0), "Multiply")
    scale = mul and _producer(mul.input_value(1), "Constant")
    if scale is None or np.asarray(scale.get_data()).size != 1:
        return None
    split = _producer(mul.input_value(0), "Reshape")
    scores = _producer((split or mul).input_value(0), "MatMul")
    k_t = scores and _producer(scores.input_value(1), "Transpose")
    if k_t is None:
        return None
    tile = _producer(add.input_value(1), "Tile")
    if split is None and tile is not None:  # grouped, tiled mask
        q_rows = _producer(scores.input_value(0), "Reshape")
        context = _consumer(softmax, "MatMul")
        heads = context and _consumer(context, "Reshape")
        return heads and q_rows and Attention(q_rows.input_value(0), k_t.input_value(0), context.input_value(1),
                                              tile.input_value(0), float(np.asarray(scale.get_data()).ravel()[0]),
                                              heads.output(0), grouped=True)
    if split is None:  # eager
        context = _consumer(softmax, "MatMul")
        return context and Attention(scores.input_value(0), k_t.input_value(0), context.input_value(1),
                                     add.input_value(1), float(np.asarray(scale.get_data()).ravel()[0]),
                                     context.output(0), grouped=False)
    q_rows = _producer(scores.input_value(0), "Reshape")
    merge = _consumer(softmax, "Reshape")
    context = merge and _consumer(merge, "MatMul")
    heads = context and _consumer(context, "Reshape")
    return heads and q_rows and Attention(q_rows.input_value(0), k_t.input_value(0), context.input_value(1),
                                          add.input_value(1), float(np.asarray(scale.get_data()).ravel()[0]),
                                          heads.output(0), grouped=True, five_d_mask=True)


def fused_attention(model) -> int:
    """Replace every attention subgraph of ``model`` by one ScaledDotProductAttention op (in place); how many.

    A grouped attention's key and value keep their h KV heads and are repeated to H with Unsqueeze -> Broadcast ->
    Reshape, the pattern that the plugin folds into its grouped-query kernel (the copy is never made).
    """
    import openvino.opset13 as ops

    found = [(node, find_attention(node)) for node in model.get_ordered_ops() if node.get_type_name() == "Softmax"]
    found = [(node, attention) for node, attention in found if attention is not None]
    if not found:
        return 0
    grouped = [node.get_friendly_name() for node, attention in found if attention.grouped]
    groups = dict(zip(grouped, _static_dims(model, grouped, 2))) if grouped else {}
    for node, attention in found:
        key, value, mask = attention.key, attention.value, attention.mask
        if attention.grouped:
            key, value = (_repeat_heads(kv, groups[node.get_friendly_name()]) for kv in (key, value))
        if attention.five_d_mask:
            mask = ops.squeeze(mask, ops.constant(np.array([2], np.int64)))  # [B, 1, 1, S, T] -> [B, 1, S, T]
        scale = ops.constant(np.array(attention.scale, np.float32))
        fused = ops.scaled_dot_product_attention(attention.query, key, value, mask, scale, causal=False)
        attention.out.replace(fused.output(0))
    model.validate_nodes_and_infer_types()
    return len(found)


def _repeat_heads(kv, groups: int):
    """[B, h, T, D] -> [B, h * groups, T, D], head j of the result = head j // groups of ``kv``."""
    import openvino.opset13 as ops

    shape = kv.get_partial_shape()
    spread = ops.broadcast(ops.unsqueeze(kv, ops.constant(np.array([2], np.int64))),
                           ops.constant(np.array([1, 1, groups, 1, 1], np.int64)), broadcast_spec="BIDIRECTIONAL")
    heads = shape[1].get_length() * groups
    return ops.reshape(spread, ops.constant(np.array([0, heads, -1, shape[3].get_length()], np.int64)),
                       special_zero=True)


def _static_dims(model, node_names: list[str], axis: int) -> list[int]:
    """Dimension ``axis`` of the named nodes' outputs, read from a copy of ``model`` with every dynamic input
    dimension set to 1 (the graphs compute their head reshapes from input shapes, so in the graph they are dynamic)."""
    probe = model.clone()
    probe.reshape({p.get_any_name(): [1 if d.is_dynamic else d.get_length() for d in p.get_partial_shape()]
                   for p in probe.inputs})
    by_name = {n.get_friendly_name(): n for n in probe.get_ordered_ops()}
    return [by_name[name].get_output_partial_shape(0)[axis].get_length() for name in node_names]


def make_stateful(model, pairs: dict[str, str]) -> None:
    """Turn each (past input -> present output) pair of ``pairs`` into one state variable (in place).

        past_key_values.i.key (input)  ->  ReadValue -> Gather(beam_idx) -> Concat(past, new) -> Assign
        present.i.key (output)         ->  gone: the state keeps it for the next call
    A state starts as zeros [B, h, 0, D], B taken from the first input's batch. The Gather by ``beam_idx`` (a new
    input, fed 0..B-1 by the session) completes the pattern the plugin needs to fuse the cache into its attention.
    """
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, pairs)
    beam = ops.parameter([-1], np.int32, name=BEAM_INPUT)
    beam.output(0).set_names({BEAM_INPUT})
    model.add_parameters([beam])
    batch = ops.gather(ops.shape_of(model.inputs[0]), ops.constant(np.array([0], np.int64)),
                       ops.constant(np.array(0, np.int64)))
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ReadValue":
            continue
        dims = [batch] + [ops.constant(np.array([d.get_length() if d.is_static else 0], np.int64))
                          for d in list(node.get_output_partial_shape(0))[1:]]  # [B, h, 0, D]
        zero = ops.constant(np.zeros((), node.get_output_element_type(0).to_dtype()))
        node.set_arguments([ops.broadcast(zero, ops.concat(dims, 0))])
        reorder = ops.gather(node.output(0), beam, ops.constant(np.array(0, np.int64)))
        for reader in list(node.output(0).get_target_inputs()):
            if reader.get_node().get_type_name() == "Concat":
                reader.replace_source_output(reorder.output(0))
    model.validate_nodes_and_infer_types()


def row_invariant_softmax(model) -> int:
    """Replace every last-axis Softmax of ``model`` (in place) by max, exp, sum-by-MatMul, divide; how many.

        scores [..., M, T]:  e = Exp(scores - ReduceMax(scores))   s = e @ ones[T, 1]   weights = e / s
    """
    import openvino.opset13 as ops

    replaced = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Softmax" or not _last_axis(node):
            continue
        scores = node.input_value(0)  # [..., M, T]
        last = ops.constant(np.array([-1], np.int64))
        exp = ops.exp(ops.subtract(scores, ops.reduce_max(scores, last, keep_dims=True)))
        slots = ops.gather(ops.shape_of(scores), last, ops.constant(np.array(0, np.int64)))  # [1] = T
        column = ops.concat([slots, ops.constant(np.array([1], np.int64))], 0)  # [T, 1]
        ones = ops.broadcast(ops.constant(np.ones((1, 1), scores.get_element_type().to_dtype())), column)
        weights = ops.divide(exp, ops.matmul(exp, ones, False, False))  # [..., M, T]
        weights.set_friendly_name(node.get_friendly_name())
        node.output(0).replace(weights.output(0))
        replaced += 1
    if replaced:
        model.validate_nodes_and_infer_types()
    return replaced


def _last_axis(node) -> bool:
    axis = int(node.get_attributes()["axis"])
    rank = node.get_output_partial_shape(0).rank
    return axis == -1 or (rank.is_static and axis == rank.get_length() - 1)
