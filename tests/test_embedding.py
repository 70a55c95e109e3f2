"""Quantized token embeddings (export/embedding.py): GGUF blocks carried bit for bit, 8-bit blocks otherwise, a
lookup that ONNX Runtime and OpenVINO run, and exports that stay exact and get smaller."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_gguf import write_gguf
from tiny_models import build_model

CARRIED = {"Q4_0": 4, "Q4_K": 4, "Q5_0": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 8}  # GGUF type -> bits per code


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("hf-wide"), "qwen2", layers=1, hidden=256)


def lookup_model(table: np.ndarray, name: str = "model.embed_tokens.weight"):
    """Gather(table, input_ids) as a model of its own: what the traced stem holds."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gather", [name, "input_ids"], ["hidden"], name="/stem/embed/Gather")], "stem",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", table.shape[1]])],
        [numpy_helper.from_array(table.astype(np.float32), name)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run_ort(model, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


@pytest.mark.parametrize("kind", sorted(CARRIED))
def test_a_gguf_embedding_is_carried_bit_for_bit(kind, wide_model, tmp_path):
    """Each format's own blocks: the lookup (numpy and ONNX Runtime) gives gguf's dequantization exactly, at the
    file's bits per code plus one float32 scale (and offset) per block."""
    from mirrorsd.export.embedding import EmbeddingPlan, gguf_table, replace_embeddings
    from mirrorsd.export.gguf_blocks import block_plan
    from mirrorsd.export.loading import open_model

    source = open_model(write_gguf(wide_model, tmp_path / "m.gguf", {"token_embd": kind}), False)
    reader = source.weights.reader
    reference = reader.get("model.embed_tokens.weight").numpy()  # gguf's dequantization, [V, 256]
    table = gguf_table(reader, "model.embed_tokens.weight")
    assert table.kind == kind
    assert np.array_equal(table.dequantize(), reference)
    assert table.codes.nbytes * 8 == CARRIED[kind] * reference.size
    plan = EmbeddingPlan("quantized", block_plan(source, "int4", "exact"))
    model = lookup_model(reference)
    assert replace_embeddings(model, plan, "prefix") == 1
    assert not any(i.name == "model.embed_tokens.weight" for i in model.graph.initializer)
    ids = np.array([[0, 5, reference.shape[0] - 1], [7, 7, 3]], np.int64)
    assert np.array_equal(run_ort(model, ids), reference[ids])
    assert plan.report("prefix") == {f"embedding.{kind}": 1.0}


def test_a_table_that_is_not_the_file_s_becomes_8_bit_blocks(wide_model, tmp_path):
    """The source's values decide: an embedding edited away from the GGUF's blocks is not carried."""
    from mirrorsd.export.embedding import EmbeddingPlan
    from mirrorsd.export.gguf_blocks import block_plan
    from mirrorsd.export.loading import open_model

    source = open_model(write_gguf(wide_model, tmp_path / "m.gguf", {"token_embd": "Q8_0"}), False)
    plan = EmbeddingPlan("quantized", block_plan(source, "int4", "exact"))
    edited = source.weights.reader.get("model.embed_tokens.weight").numpy().copy()
    edited[3, 5] += 1.0
    assert plan.table("prefix", "model.embed_tokens.weight", edited).kind == "int8"
    assert EmbeddingPlan("quantized", block_plan(source, "int4", "requantize")).table(
        "prefix", "model.embed_tokens.weight", edited + 0).kind == "int8"


def test_8_bit_blocks_are_within_half_a_step_and_run_alike_everywhere():
    """Float sources: symmetric 8-bit blocks of 32; ONNX Runtime and OpenVINO (CPU, f32) compute the same rows."""
    from mirrorsd.devices.openvino_import import load_openvino
    from mirrorsd.export.embedding import EmbeddingPlan, int8_table, replace_embeddings

    ov = load_openvino()
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((300, 96)) * np.exp2(rng.integers(-6, 3, (300, 1)))).astype(np.float32)
    weight[4] = 0.0  # an all-zero row: scale 0, codes at the centre
    table = int8_table(weight)
    step = np.repeat(table.scales, 32, axis=1)
    assert np.all(np.abs(table.dequantize() - weight) <= step / 2 * (1 + 1e-6))
    assert np.array_equal(table.dequantize()[4], np.zeros(96, np.float32))
    model = lookup_model(weight)
    assert replace_embeddings(model, EmbeddingPlan("quantized"), "draft") == 1
    ids = rng.integers(0, 300, size=(3, 7)).astype(np.int64)
    expected = table.dequantize()[ids]
    assert np.array_equal(run_ort(model, ids), expected)
    compiled = ov.Core().compile_model(ov.Core().read_model(model.SerializeToString(), b""), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.array_equal(compiled({"input_ids": ids})[compiled.output(0)], expected)


def test_float_mode_and_other_gathers_are_left_alone():
    from mirrorsd.errors import ExportOptionError
    from mirrorsd.export.embedding import EmbeddingPlan, check_mode, replace_embeddings

    weight = np.ones((64, 32), np.float32)
    assert replace_embeddings(lookup_model(weight), EmbeddingPlan("float"), "prefix") == 0
    other = lookup_model(weight, name="exit_sparse.rows")
    other.graph.node[0].input[1] = "candidate_ids"
    other.graph.input[0].name = "candidate_ids"
    assert replace_embeddings(other, EmbeddingPlan("quantized"), "prefix") == 0
    with pytest.raises(ExportOptionError, match="--embedding 'int3' is not a mode"):
        check_mode("int3")


def graph_bytes(folder: Path, role: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"{role}.onnx*"))


def test_exports_store_the_embedding_quantized_and_stay_exact(tiny_model, tmp_path):
    """Default: the target's prefix and the draft hold 8-bit codes instead of the float table (smaller files,
    counted in the manifest), and sd and mirror still emit ar's tokens; --embedding float keeps the table."""
    import onnx

    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.runtime import GenerationConfig, Pipeline

    source = tiny_model("qwen2", layers=4)
    folders = {}
    for mode in ("quantized", "float"):
        folders[mode] = tmp_path / mode
        export(ExportOptions(model=source, output=folders[mode], target_precision="int4", draft_precision="int4",
                             draft_layers=1, embedding=mode))
    manifest = json.loads((folders["quantized"] / "mirrorsd.json").read_text())
    assert manifest["export_options"]["embedding"] == "quantized"
    for role in ("prefix", "draft"):
        assert manifest["graphs"][role]["validation"]["embedding.int8"] == 1.0
        graph = onnx.load(str(folders["quantized"] / f"{role}.onnx"))
        assert {i.name for i in graph.graph.initializer} >= {"model.embed_tokens.weight.codes"}
        assert "model.embed_tokens.weight" not in {i.name for i in graph.graph.initializer}
        assert graph_bytes(folders["quantized"], role) < graph_bytes(folders["float"], role)
    float_graph = onnx.load(str(folders["float"] / "prefix.onnx"))
    assert "model.embed_tokens.weight" in {i.name for i in float_graph.graph.initializer}
    with Pipeline.load(folders["quantized"]) as pipe:
        for prompt in ([1, 17, 42, 99, 7], [3, 3, 3, 100, 200, 12], [250]):
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=16)).tokens
            assert len(ar) == 16
            for decoding in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=decoding, max_new_tokens=16)).tokens == ar


def test_mirrorsd_quantize_takes_the_embedding_option(exported, tmp_path):
    import onnx

    from mirrorsd.export.requantize import requantize

    fp32 = exported("llama")
    for mode, kept in (("quantized", False), ("float", True)):
        out = requantize(fp32, tmp_path / mode, draft_precision="int8", embedding=mode)
        names = {i.name for i in onnx.load(str(out / "draft.onnx")).graph.initializer}
        assert ("model.embed_tokens.weight" in names) == kept
        manifest = json.loads((out / "mirrorsd.json").read_text())
        assert manifest["export_options"]["embedding"] == mode
        assert ("embedding.int8" in manifest["graphs"]["draft"]["validation"]) != kept


def test_the_bandwidth_ceiling_leaves_out_the_stored_table(exported, tmp_path):
    """ar's ceiling counts the weights a step reads: the prefix and suffix files less the embedding as stored
    (float or quantized), within the lookup's small byte table."""
    import onnx
    from onnx import numpy_helper

    from mirrorsd.apps.bandwidth import target_weight_bytes
    from mirrorsd.export.requantize import requantize
    from mirrorsd.manifest import load_manifest

    fp32 = exported("llama")
    for folder in (fp32, requantize(fp32, tmp_path / "q", target_precision="int4")):
        files = sum(p.stat().st_size for role in ("prefix", "suffix") for p in folder.glob(f"{role}.onnx*"))
        table = sum(numpy_helper.to_array(i).nbytes for i in onnx.load(str(folder / "prefix.onnx")).graph.initializer
                    if "embed_tokens.weight" in i.name and not i.name.endswith((".values", ".blocks", ".hidden")))
        assert 0 <= target_weight_bytes(folder, load_manifest(folder)) - (files - table) <= 64
