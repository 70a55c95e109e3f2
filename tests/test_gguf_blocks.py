"""Lossless GGUF import: a GGUF's Q4_0 / Q5_0 / Q8_0 blocks become MatMulNBits weights that ONNX Runtime dequantizes
bitwise to gguf's own dequantization; formats that do not map (Q4_1 here) are requantized, and the manifest counts
both. The file is written by the ``gguf`` package (tests/tiny_gguf.py) and exported for real."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_gguf import LAYER_TENSORS, write_gguf
from tiny_models import build_model

TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_0", "ffn_down": "Q5_0", "output": "Q4_0", "token_embd": "Q8_0"}
CANNOT_SURVIVE = {("Q8_0", "int4"), ("Q5_0", "int4"), ("Q4_1", "int4"), ("Q4_1", "int8")}
HF_TO_KIND = {part: kind for kind, part in LAYER_TENSORS.items()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gguf")
    return write_gguf(build_model(base / "hf", "qwen2", layers=2), base / "tiny.gguf", TYPES)


@pytest.fixture(scope="module")
def exports(tiny_gguf, tmp_path_factory):
    """{mode: export folder}: int4 target, int8 draft (the target's first layer)."""
    from mirrorsd.export.pipeline import ExportOptions, export

    out = {}
    for mode in ("exact", "widen", "requantize"):
        folder = tmp_path_factory.mktemp(mode) / "out"
        export(ExportOptions(model=tiny_gguf, output=folder, target_precision="int4", draft_precision="int8",
                             draft_layers=1, gguf_blocks=mode))
        out[mode] = folder
    return out


def gguf_name(parameter: str) -> str:
    """model.layers.0.mlp.up_proj.weight -> blk.0.ffn_up.weight; lm_head.weight -> output.weight."""
    if parameter == "lm_head.weight":
        return "output.weight"
    _, _, layer, *part, _ = parameter.split(".")
    return f"blk.{layer}.{HF_TO_KIND['.'.join(part)]}.weight"


def gguf_weights(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (type name, gguf's own dequantization [N, K] float32)."""
    from gguf import GGUFReader, dequantize

    return {t.name: (t.tensor_type.name, dequantize(t.data, t.tensor_type)) for t in GGUFReader(str(path)).tensors}


def nbits_nodes(graph_file: Path) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """Model parameter -> (bits, the weight [K, N] ONNX Runtime computes with, the weight [N, K] dequantized from the
    node's initializers as MatMulNBits defines it), for every MatMulNBits node. ONNX Runtime's: the node run alone on
    an identity matrix in float32 (accuracy level 1), so its output is the dequantized weight (up to the sign of
    zeros, which a sum of products does not keep)."""
    from mirrorsd.export.gguf_blocks import dequantize_nbits

    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_file))
    inits = {i.name: i for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert len(node.input) == 3, "carried and quantized weights alike have no zero points"
        k, n = attrs["K"], attrs["N"]
        one = helper.make_graph(
            [helper.make_node("MatMulNBits", ["a", *node.input[1:]], ["y"], domain="com.microsoft",
                              **{**attrs, "accuracy_level": 1})], "one",
            [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [k, k])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [k, n])],
            [numpy_helper.from_array(numpy_helper.to_array(inits[name]), name) for name in node.input[1:]])
        single = helper.make_model(one, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)])
        session = ort.InferenceSession(single.SerializeToString(), providers=["CPUExecutionProvider"])
        parameter = node.input[1].rsplit(".T_Q", 1)[0]
        packed, scales = (numpy_helper.to_array(inits[name]) for name in node.input[1:])
        found[parameter] = (attrs["bits"], session.run(None, {"a": np.eye(k, dtype=np.float32)})[0],
                            dequantize_nbits(packed, scales, attrs["bits"]))
    return found


def carried_as(mode: str, precision: str, kind: str) -> int | None:
    """The bit width a GGUF type is carried at, or None when it is requantized (gguf_blocks.py's table)."""
    maps = {"Q4_0": (4, 8), "Q5_0": (8,), "Q8_0": (8,)}.get(kind, ())
    bits = {"int4": 4, "int8": 8}[precision]
    if mode == "requantize":
        return None
    if bits in maps:
        return bits
    return 8 if mode == "widen" and 8 in maps else None


@pytest.mark.parametrize("mode", ["exact", "widen", "requantize"])
def test_carried_blocks_dequantize_bitwise_to_gguf(exports, tiny_gguf, mode):
    from mirrorsd import names

    source = gguf_weights(tiny_gguf)
    manifest = json.loads((exports[mode] / "mirrorsd.json").read_text())
    assert manifest["export_options"]["gguf_blocks"] == mode
    for role, precision in ((names.PREFIX, "int4"), (names.SUFFIX, "int4"), (names.DRAFT, "int8")):
        expected_counts: dict[str, float] = {}
        nodes = nbits_nodes(exports[mode] / names.graph_file(role))
        assert nodes, f"{role} has MatMulNBits nodes"
        for parameter, (bits, computed, defined) in nodes.items():
            kind, reference = source[gguf_name(parameter)]
            carried = carried_as(mode, precision, kind)
            bitwise = np.array_equal(defined.view(np.uint32), reference.view(np.uint32))
            if carried:
                assert bits == carried and bitwise, f"{role} {parameter} ({kind}) must be the GGUF's blocks"
                assert np.array_equal(computed.T, reference), f"ONNX Runtime computes with {parameter} as stored"
            else:  # requantized: a block whose grid is a sub-grid of the new one re-rounds to itself (Q4_0 with
                # a -8d extreme), so only wider grids or float offsets must differ
                assert bits == {"int4": 4, "int8": 8}[precision], f"{role} {parameter} ({kind})"
                if (kind, precision) in CANNOT_SURVIVE:
                    assert not bitwise, f"{role} {parameter} ({kind}) cannot survive requantizing to {precision}"
            key = f"gguf_{'carried' if carried else 'requantized'}.{kind}"
            expected_counts[key] = expected_counts.get(key, 0) + 1
        validation = manifest["graphs"][role]["validation"]
        assert {k: v for k, v in validation.items() if k.startswith("gguf_")} == expected_counts


def test_carrying_is_at_least_as_close_to_the_source(exports):
    """Fewer second roundings: the quantized target moves less from the (dequantized) GGUF model."""
    def effect(mode):
        validation = json.loads((exports[mode] / "mirrorsd.json").read_text())["graphs"]["suffix"]["validation"]
        return validation["target_quant_max_abs_diff"]

    assert effect("widen") <= effect("exact") <= effect("requantize") * 1.0001


def test_an_unknown_mode_is_refused(tiny_gguf, tmp_path):
    from mirrorsd.errors import ExportOptionError
    from mirrorsd.export.pipeline import ExportOptions, export

    with pytest.raises(ExportOptionError, match="--gguf-blocks 'all' is not a mode"):
        export(ExportOptions(model=tiny_gguf, output=tmp_path / "out", gguf_blocks="all"))
    assert not (tmp_path / "out").exists()


def test_packing_round_trips():
    from mirrorsd.export.gguf_blocks import pack, unpack

    codes = np.random.default_rng(0).integers(0, 16, size=(3, 2, 32)).astype(np.uint8)
    packed = pack(codes, 4)
    assert packed.shape == (3, 2, 16) and (packed[..., 0] & 0x0F == codes[..., 0]).all()
    assert np.array_equal(unpack(packed, 4), codes)


def test_the_export_records_a_real_text_agreement_beside_the_random_ids(exports):
    """The export-time check keeps its random-id figures and adds top-1 agreement with fp32 on the shipped text."""
    graphs = json.loads((exports["exact"] / "mirrorsd.json").read_text())["graphs"]
    for role, model in (("suffix", "target"), ("draft", "draft")):
        validation = graphs[role]["validation"]
        assert {f"{model}_quant_top1_agreement", f"{model}_quant_max_abs_diff"} <= set(validation)
        assert 0.0 <= validation[f"{model}_quant_text_top1_agreement"] <= 1.0
    # the int8 draft of a GGUF whose blocks all carry at 8 bits but one: fp32 and int8 agree almost everywhere
    assert graphs["draft"]["validation"]["draft_quant_text_top1_agreement"] >= 0.9
