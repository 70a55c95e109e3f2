"""Layer-streamed export: the graphs equal the whole-graph trace, int4 written layer by layer equals int4 made
afterwards, bf16 checkpoints are read as the whole-model load reads them, and --resume continues a stopped export."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mirrorsd import names
from mirrorsd.errors import ExportOptionError
from mirrorsd.export import assembly
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.export.validate import SPLIT_AT, FileRunner, Run, chunked, sample_batch
from mirrorsd.manifest import load_manifest

from tiny_models import build_model


def graph_outputs(folder: Path) -> dict:
    """Every graph of ``folder`` run on a batch (whole and in two chunks with KV): {(role, run, output): array}."""
    manifest = load_manifest(folder)
    ids, mask, pos = sample_batch(manifest.target.vocab_size, seed=7)
    hidden = np.random.default_rng(7).standard_normal((*ids.shape, manifest.target.hidden_size)).astype(np.float32)
    out = {}
    for role, spec in manifest.graphs.items():
        first = ids if spec.inputs[0].name == names.INPUT_IDS else hidden
        runs = chunked(spec.inputs[0].name, (first, first[:, :SPLIT_AT], first[:, SPLIT_AT:]), mask, pos) \
            if spec.kv else [Run("full", {spec.inputs[0].name: first})]
        for run, outputs in FileRunner(folder / spec.file, spec.kv).run(runs).items():
            out.update({(role, run, name): value for name, value in outputs.items()})
    return out


def manifest_without_versions(folder: Path) -> dict:
    data = json.loads((folder / names.MANIFEST_FILE).read_text())
    data.pop("versions")
    return data


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # tied head; q/k/v biases; q/k norms
def test_streamed_graphs_equal_the_whole_graph_trace(arch, exported, tiny_model, tmp_path):
    streamed = exported(arch)
    whole = tmp_path / "whole"
    export(ExportOptions(model=tiny_model(arch), output=whole, whole_graphs=True))
    assert manifest_without_versions(streamed) == manifest_without_versions(whole)  # validation numbers included
    got, want = graph_outputs(streamed), graph_outputs(whole)
    assert got.keys() == want.keys()
    for key, value in got.items():
        np.testing.assert_allclose(value, want[key], rtol=0, atol=1e-5, err_msg=str(key))


def initializers_and_nodes(path: Path):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return tensors, [n.SerializeToString() for n in model.graph.node], sorted((o.domain, o.version)
                                                                             for o in model.opset_import)


def test_int4_written_layer_by_layer_equals_int4_made_afterwards(exported, tiny_model, tmp_path):
    from mirrorsd.export.requantize import requantize

    streamed = tmp_path / "streamed"
    export(ExportOptions(model=tiny_model("qwen2"), output=streamed, draft_layers=2, target_precision="int4",
                         draft_precision="int4"))
    afterwards = requantize(exported("qwen2", draft_layers=2), tmp_path / "afterwards", "int4", "int4")
    a, b = load_manifest(streamed), load_manifest(afterwards)
    for role, spec in a.graphs.items():
        tensors, nodes, opsets = initializers_and_nodes(streamed / spec.file)
        tensors_b, nodes_b, opsets_b = initializers_and_nodes(afterwards / spec.file)
        assert any(n.startswith(b"\n") and b"MatMulNBits" in n for n in nodes), role  # really quantized
        assert nodes == nodes_b and opsets == opsets_b, role
        assert tensors.keys() == tensors_b.keys(), role
        for name, value in tensors.items():
            assert value.dtype == tensors_b[name].dtype and np.array_equal(value, tensors_b[name]), (role, name)
        for check, value in spec.validation.items():  # the effect on logits: fp32 run piece by piece vs whole
            assert value == pytest.approx(b.graph(role).validation[check], abs=1e-5), (role, check)


def test_a_bf16_checkpoint_exports_as_its_float32_load(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bf16"
    build_model(folder, "qwen2", layers=3, seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    export(ExportOptions(model=folder, output=streamed, draft_layers=1))
    export(ExportOptions(model=folder, output=whole, draft_layers=1, whole_graphs=True))
    got, want = graph_outputs(streamed), graph_outputs(whole)
    assert all(np.array_equal(value, want[key]) for key, value in got.items())


def count_writes(monkeypatch, fail_at: int | None = None) -> list[str]:
    """Record every graph the streamed writer writes; raise KeyboardInterrupt at the ``fail_at``-th one."""
    written: list[str] = []
    real = assembly.write_stack

    def write(stack, pieces, source, path, *args, **kwargs):
        if fail_at is not None and len(written) + 1 == fail_at:
            raise KeyboardInterrupt
        written.append(Path(path).stem)
        return real(stack, pieces, source, path, *args, **kwargs)

    monkeypatch.setattr(assembly, "write_stack", write)
    return written


def test_resume_after_an_interrupt_gives_the_same_folder(tiny_model, tmp_path, monkeypatch):
    options = ExportOptions(model=tiny_model("llama"), output=tmp_path / "out", draft_layers=2,
                            target_precision="int4", resume=True)
    kept = tmp_path / ".out.partial"
    with pytest.raises(KeyboardInterrupt):
        with monkeypatch.context() as patch:
            count_writes(patch, fail_at=3)  # prefix and exit_head written, then Ctrl-C while starting the suffix
            export(options)
    assert not options.output.exists()
    assert {"prefix.onnx", "exit_head.onnx", "resume.json"} <= {p.name for p in kept.iterdir()}
    with pytest.raises(ExportOptionError, match="made differently"):  # another exit layer: refused, nothing lost
        export(ExportOptions(**{**options.__dict__, "exit_layer": 1}))
    assert (kept / "prefix.onnx").is_file()
    written = count_writes(monkeypatch)
    export(options)
    assert written == ["suffix", "draft"]  # the finished graphs were not redone
    assert not kept.exists() and not (options.output / "resume.json").exists()
    monkeypatch.undo()
    fresh = tmp_path / "fresh"
    export(ExportOptions(**{**options.__dict__, "output": fresh, "resume": False}))
    assert digests(options.output) == digests(fresh)


def test_fp16_graphs_keep_the_float32_contract(tiny_model, tmp_path):
    import onnx

    from mirrorsd.export.requantize import requantize

    out = tmp_path / "f16"
    export(ExportOptions(model=tiny_model("qwen2"), output=out, draft_layers=2, target_precision="fp16",
                         draft_precision="fp16"))
    manifest = load_manifest(out)
    for spec in manifest.graphs.values():
        model = onnx.load(str(out / spec.file))
        contract = {t.name: t.dtype for t in (*spec.inputs, *spec.outputs)}
        declared = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
                    for v in (*model.graph.input, *model.graph.output)}
        assert declared == contract, spec.role  # float32 in and out, as docs/graphs.md says
        assert {t.data_type for t in model.graph.initializer if t.dims} >= {onnx.TensorProto.FLOAT16}, spec.role
    suffix = manifest.graph("suffix").validation
    assert suffix["split_logits"] < 1e-3 and 0 < suffix["target_quant_max_abs_diff"] < 1.0  # fp32 checked, fp16 measured
    assert graph_outputs(out)  # every graph runs in ONNX Runtime
    with pytest.raises(ExportOptionError, match="whole-graphs"):
        export(ExportOptions(model=tiny_model("qwen2"), output=tmp_path / "x", target_precision="fp16",
                             whole_graphs=True))
    with pytest.raises(ExportOptionError, match="not a precision here"):
        requantize(out, tmp_path / "y", "fp16", "fp32")
