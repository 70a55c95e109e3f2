"""export/shape_constants.py: shape arithmetic folded into constants only where it holds at every size, bit for bit."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from mirrorsd.export import shape_constants  # noqa: E402
from mirrorsd.export.shape_constants import FoldReport, _reshape_constant, fold, random_feeds  # noqa: E402


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(nodes, inits, outputs):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def traced_like() -> onnx.ModelProto:
    """x [batch, seq, 8] -> reshape(batch, seq, 2, 4) with the shape computed as a tracer writes it; a slice
    x[:, :seq] (the whole axis) and a slice x[:, :seq - 1] (not the whole axis)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axis0"], ["batch1"]),
        helper.make_node("Unsqueeze", ["seq", "axis0"], ["seq1"]),
        helper.make_node("Concat", ["batch1", "seq1", "two_four"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["split"]),
        helper.make_node("Slice", ["x", "zero1", "seq1", "one1"], ["whole"]),
        helper.make_node("Sub", ["seq1", "one1"], ["seq_less"]),
        helper.make_node("Slice", ["x", "zero1", "seq_less", "one1"], ["part"]),
    ]
    inits = [_ints("zero", 0), _ints("one", 1), _ints("axis0", [0]), _ints("two_four", [2, 4]),
             _ints("zero1", [0]), _ints("one1", [1])]
    return _model(nodes, inits, ["split", "whole", "part"])


def _feeds(model):
    return lambda dims: random_feeds(model.graph, {"batch": dims[0], "seq": dims[1]},
                                     lambda name, shape: np.zeros(shape, np.int64), seed=sum(dims))


def _run_all(model, probes=shape_constants.PROBES):
    names = [o.name for o in model.graph.output]
    run = shape_constants.onnxruntime_runner(model.SerializeToString())
    return [run(_feeds(model)(d), names) for d in probes]


def test_reshape_constant_copies_known_dims_and_infers_one():
    # [b, 14, s, 64] -> [b, 2, 7 s, 64]: the batch copied, the heads' split inferred
    pairs = [((b, 14, s, 64), (b, 2, 7 * s, 64)) for b, s in ((1, 1), (2, 3), (3, 5))]
    assert _reshape_constant(pairs).tolist() == [0, 2, -1, 64]


def test_reshape_constant_refuses_two_unknown_dims_and_empty_inference():
    # [b, 2, 7 s, t] -> [b, 2, 7, s, t]: s and t both move, so no constant holds
    pairs = [((b, 2, 7 * s, t), (b, 2, 7, s, t)) for b, s, t in ((1, 1, 4), (2, 3, 5), (3, 5, 9))]
    assert _reshape_constant(pairs) is None
    # an empty cache (past 0): dims copied with 0 still hold
    assert _reshape_constant([((1, 0, 8), (1, 0, 2, 4)), ((2, 3, 8), (2, 3, 2, 4))]).tolist() == [0, 0, 2, 4]
    # a constant that fits one probe but not another is refused
    assert _reshape_constant([((2, 6), (2, 3, 2)), ((2, 8), (2, 4, 2))]).tolist() == [2, -1, 2]
    assert _reshape_constant([((2, 6), (2, 3, 2)), ((2, 8), (2, 2, 4))]) is None


def test_fold_keeps_outputs_bitwise_and_drops_the_arithmetic():
    model = traced_like()
    want = _run_all(model)
    report = fold(model, _feeds(model), shape_constants.onnxruntime_runner)
    ops = Counter(n.op_type for n in model.graph.node)
    assert not report.kept_because
    assert report.reshapes == 1 and report.identities == 1
    reshape = next(n for n in model.graph.node if n.op_type == "Reshape")
    target = next(t for t in model.graph.initializer if t.name == reshape.input[1])
    assert numpy_helper.to_array(target).tolist() == [0, 0, 2, 4]
    assert ops["Identity"] == 1  # x[:, :seq] is x
    assert ops["Slice"] == 1 and ops["Sub"] == 1  # x[:, :seq - 1] depends on seq: kept, with what computes it
    assert report.nodes_after < report.nodes_before
    for before, after in zip(want, _run_all(model)):
        for a, b in zip(before, after):
            assert a.shape == b.shape and np.array_equal(a, b)


def test_a_fold_that_changes_an_output_is_not_kept():
    model = traced_like()
    original = model.SerializeToString()
    opened = []

    def open_and_spoil(model_bytes):  # opened in turn: the traced piece with extra outputs, as it is, then folded
        run = shape_constants.onnxruntime_runner(model_bytes)
        opened.append(model_bytes)
        spoil = len(opened) == 3  # the folded one reports other values
        return lambda feeds, names: [v + 1 if spoil and k == 0 else v for k, v in enumerate(run(feeds, names))]

    report = fold(model, _feeds(model), open_and_spoil)
    assert "did not match" in report.kept_because
    assert model.SerializeToString() == original


def test_a_piece_that_fails_at_a_probe_is_kept_as_traced():
    model = traced_like()
    original = model.SerializeToString()

    def fail(feeds, names):
        raise RuntimeError("cannot run at this size")

    report = fold(model, _feeds(model), lambda model_bytes: fail)
    assert "fails at a probe" in report.kept_because
    assert model.SerializeToString() == original


def test_float16_layer_piece_folds(tmp_path):
    """The reference is the piece as traced, without the extra outputs that the probes read: in float16 those
    change the piece's bits, and a fold checked against them was refused."""
    pytest.importorskip("torch")
    import torch
    from transformers import AutoConfig

    from mirrorsd.export.architectures import architecture_for
    from mirrorsd.export.templates import trace_pieces
    from tests.tiny_models import build_model

    folder = build_model(tmp_path / "m", "llama", layers=1)
    config = AutoConfig.from_pretrained(folder)
    reports = []
    real = shape_constants.fold
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shape_constants, "fold", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
        trace_pieces(config, architecture_for(config.model_type), {"layer"}, 4, torch.float16)
    assert len(reports) == 1 and not reports[0].kept_because
    assert reports[0].nodes_after < reports[0].nodes_before


def test_decoder_layer_piece_loses_most_shape_nodes(tmp_path):
    """A real traced layer (tiny Qwen2): the folded piece has far fewer nodes, and pieces still give the
    model's logits (export validation, run by the export tests, checks whole graphs against PyTorch)."""
    pytest.importorskip("torch")
    from transformers import AutoConfig

    from mirrorsd.export.architectures import architecture_for
    from mirrorsd.export.templates import trace_pieces
    from tests.tiny_models import build_model

    folder = build_model(tmp_path / "m", "qwen2", layers=1)
    config = AutoConfig.from_pretrained(folder)
    with pytest.MonkeyPatch.context() as patch:
        unfolded = {}
        patch.setattr(shape_constants, "fold", lambda model, *a, **k: unfolded.setdefault("n", len(model.graph.node))
                      and FoldReport())
        trace_pieces(config, architecture_for(config.model_type), {"layer"}, 4)
    folded = trace_pieces(config, architecture_for(config.model_type), {"layer"}, 4)["layer"]
    shapes = Counter(n.op_type for n in folded.graph.node)["Shape"]
    assert len(folded.graph.node) < 0.7 * unfolded["n"]
    assert shapes <= 4  # what is left: the attention's 5-d score reshape needs both the rows and the slots
