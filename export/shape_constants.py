"""Replace a traced piece's shape arithmetic by constants, where the constants hold for every input size.

The tracer records every ``x.shape[i]`` a module reads as nodes: Shape -> Gather -> Unsqueeze -> Concat -> Reshape.
A decoder layer of Qwen2 carries ~50 of them (half of the nodes ONNX Runtime runs per layer), recomputed on every
forward, though most of what they compute is either a constant (head_dim // 2, the KV head count) or "the same as the
input's dim i". Measured on the int4 Qwen pair (2-core AMD EPYC): with all shape arithmetic folded in a fixed-shape
copy, a draft forward ran 11 % faster and a target half 5 % (docs/lab-notes/performance-log.md).

What this pass rewrites, where every probe agrees (a probe runs the piece at one (batch, seq, past) size):

    Reshape(x, shape)        shape computed  ->  a constant, each dim an int, 0 (= x's dim i) or one -1
    Slice/Expand(x, ...)     output shape == x's shape in every probe  ->  Identity(x)
    any input computed from shapes alone whose value is the same in every probe  ->  that constant

Then the nodes nobody reads any more are dropped. The rewritten piece is run again at every probe and must give the
original's outputs bit for bit (only shapes change, never arithmetic); if any probe differs or fails, the piece is
kept as traced. Probes cover one-row decoding (seq 1), prefill without a cache (past 0) and odd sizes, so that no
dim is taken for a constant by coincidence. Export-time validation against PyTorch then checks the whole graph.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# (batch, seq, past): one-row decoding, prefill with and without a cache, verification windows, odd sizes, and one
# longer cache (a value that only changes past some size would be taken for a constant if no probe reached it).
PROBES = ((1, 1, 0), (1, 1, 5), (2, 3, 2), (3, 5, 7), (1, 4, 0), (4, 2, 11), (1, 2, 300))
BYPASSED = ("Slice", "Expand")  # ops that are the identity where their output keeps their input's shape
SHAPE_SOURCES = ("Shape", "Size")


@dataclass
class FoldReport:
    """What the pass did to one piece."""

    nodes_before: int = 0
    nodes_after: int = 0
    reshapes: int = 0  # shape inputs made constant
    identities: int = 0  # Slice/Expand that keep their input's shape
    constants: int = 0  # other shape-derived inputs made constant
    kept_because: str = ""  # why the piece was kept as traced (empty when rewritten)


def shape_derived(graph) -> set[str]:
    """Tensors computed from tensor shapes and constants alone (their values depend on input sizes, not on data)."""
    constant = {t.name for t in graph.initializer}
    derived: set[str] = set()
    for node in graph.node:
        if node.op_type == "Constant":
            constant.update(node.output)
        elif node.op_type in SHAPE_SOURCES:
            derived.update(node.output)
        elif node.input and any(i in derived for i in node.input) and \
                all(i in derived or i in constant or not i for i in node.input):
            derived.update(node.output)
    return derived


@dataclass(frozen=True)
class Plan:
    """The tensors a probe must return: computed shape inputs, and the data in/out of each candidate node."""

    inputs: tuple  # (node index, input index) of every shape-derived input read by a data node
    watched: tuple  # tensor names whose values or shapes the decisions need

    @staticmethod
    def of(graph) -> "Plan":
        derived = shape_derived(graph)
        inputs, watched = [], set()
        for k, node in enumerate(graph.node):
            if set(node.output) <= derived:
                continue  # part of the arithmetic itself
            for i, name in enumerate(node.input):
                if name in derived:
                    inputs.append((k, i))
                    watched.update((name, node.input[0], node.output[0]))
        return Plan(tuple(inputs), tuple(sorted(watched)))


def _reshape_constant(shapes: list[tuple[tuple, tuple]]) -> np.ndarray | None:
    """A Reshape target valid for every (input shape, output shape) pair, or None."""
    rank = len(shapes[0][1])
    if any(len(out) != rank for _, out in shapes):
        return None
    dims = []
    for i in range(rank):
        column = {out[i] for _, out in shapes}
        if len(column) == 1 and 0 not in column:
            dims.append(column.pop())
        elif all(i < len(x) and x[i] == out[i] for x, out in shapes):
            dims.append(0)
        else:
            dims.append(-1)
    if dims.count(-1) > 1:
        return None
    target = np.array(dims, np.int64)
    return target if all(_reshaped(x, target) == out for x, out in shapes) else None


def _reshaped(shape: tuple, target: np.ndarray) -> tuple | None:
    """ONNX Reshape's output shape (allowzero 0) for an input ``shape``, or None where -1 cannot be inferred."""
    dims = [shape[i] if d == 0 else int(d) for i, d in enumerate(target)]
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        total = int(np.prod(shape))
        if known == 0 or total % known:
            return None
        dims[dims.index(-1)] = total // known
    return tuple(dims) if int(np.prod(dims)) == int(np.prod(shape)) else None


def rewrite(graph, plan: Plan, probes: list[dict[str, np.ndarray]], report: FoldReport) -> None:
    """Apply the decisions that every probe (tensor name -> value) agrees on; edits ``graph`` in place."""
    from onnx import helper

    nodes = [_copy(n) for n in graph.node]
    replaced: set[int] = set()
    for k, i in plan.inputs:
        if k in replaced:
            continue
        node = nodes[k]
        name = node.input[i]
        values = [p[name] for p in probes]
        io_shapes = [(p[node.input[0]].shape, p[node.output[0]].shape) for p in probes]
        if node.op_type == "Reshape" and i == 1:
            target = _reshape_constant(io_shapes)
            if target is None:
                continue
            node.input[i] = _add_constant(graph, f"{node.name or node.output[0]}/shape_const", target)
            report.reshapes += 1
        elif node.op_type in BYPASSED and i > 0 and all(x == out for x, out in io_shapes):
            nodes[k] = helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
            replaced.add(k)
            report.identities += 1
        elif all(_same(v, values[0]) for v in values):
            node.input[i] = _add_constant(graph, f"{node.name or node.output[0]}/input{i}_const", values[0])
            report.constants += 1
    del graph.node[:]
    graph.node.extend(_live(nodes, {o.name for o in graph.output}))


def _copy(node):
    copy = type(node)()
    copy.CopyFrom(node)
    return copy


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (NaN where NaN), shapes and dtypes included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        return bool(np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")))
    return bool(np.array_equal(a, b))


def _add_constant(graph, name: str, value: np.ndarray) -> str:
    from onnx import numpy_helper

    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _live(nodes: list, outputs: set[str]) -> list:
    """The nodes whose outputs something still reads (graph outputs included), in order."""
    needed = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1]


def _drop_unused_initializers(graph) -> None:
    read = {i for node in graph.node for i in node.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def fold(model, feeds_for: Callable[[tuple], dict], open_model: Callable, probes=PROBES) -> FoldReport:
    """Fold ``model``'s shape arithmetic (an onnx.ModelProto, edited in place) where every probe agrees.

    ``feeds_for(dims)`` gives the inputs of one probe; ``open_model(model_bytes)`` returns ``run(feeds, names)``, which
    returns the values of ``names`` (graph outputs or any intermediate tensor); each model is opened once. A piece
    whose rewrite is not bitwise equal at every probe, or which fails at a probe as traced, is left as it was
    (``report.kept_because`` says why)."""
    import onnx

    graph = model.graph
    report = FoldReport(nodes_before=len(graph.node), nodes_after=len(graph.node))
    plan = Plan.of(graph)
    if not plan.inputs:  # nothing to fold
        return report
    outputs = [o.name for o in graph.output]
    watched = [n for n in plan.watched if n not in outputs]
    try:
        feeds = [feeds_for(d) for d in probes]
        run = open_model(_with_outputs(model, watched))
        before = [dict(zip(outputs + watched, run(f, outputs + watched))) for f in feeds]
        # the reference outputs come from the piece as it is: extra graph outputs can change its arithmetic (a
        # float16 layer piece with them computed other bits than without, at every optimization level)
        run = open_model(model.SerializeToString())
        want = [dict(zip(outputs, run(f, outputs))) for f in feeds]
    except Exception as exc:  # ONNX Runtime's own error types; the traced piece itself fails at some size
        report.kept_because = f"the traced piece fails at a probe size: {str(exc).splitlines()[0][:200]}"
        return report
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    rewrite(folded.graph, plan, before, report)
    _drop_unused_initializers(folded.graph)
    try:
        run = open_model(folded.SerializeToString())
        for dims, f, expected in zip(probes, feeds, want):
            got = run(f, outputs)
            for name, value in zip(outputs, got):
                if not _same(value, expected[name]):
                    raise ValueError(f"output {name} differs at probe {dims}")
    except Exception as exc:  # a rewrite that is not exact is a bug here; keep the traced piece and say so
        report.kept_because = f"the folded piece did not match: {str(exc).splitlines()[0][:200]}"
        return report
    graph.CopyFrom(folded.graph)
    report.nodes_after = len(graph.node)
    return report


def _with_outputs(model, names: list[str]) -> bytes:
    """``model``'s bytes with ``names`` added as graph outputs (types left to ONNX Runtime)."""
    import onnx
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return probe.SerializeToString()


def onnxruntime_runner(model_bytes: bytes) -> Callable[[dict, list], list]:
    """``run(feeds, names)`` on one CPU session at the runtime's optimization level (so that its fusions see the
    folded shapes too)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    return lambda feeds, names: session.run(names, feeds)


ELEMENT_TYPES = {1: np.float32, 10: np.float16, 7: np.int64, 6: np.int32, 9: np.bool_}


def random_feeds(graph, sizes: dict[str, int], integer_values: Callable[[str, tuple], np.ndarray],
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for ``graph`` with each named dim taken from ``sizes``: floats random normal, integers from
    ``integer_values(input name, shape)``."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in graph.input:
        shape = tuple(sizes[d.dim_param] if d.dim_param else d.dim_value for d in spec.type.tensor_type.shape.dim)
        dtype = ELEMENT_TYPES[spec.type.tensor_type.elem_type]
        if np.issubdtype(dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[spec.name] = integer_values(spec.name, shape).astype(dtype)
    return feeds
