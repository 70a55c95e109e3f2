"""Packed weight storage (mirrorsd-export --weight-storage packed, export/packed_weights.py): a GGUF's Q4_K scales and
Q6_K blocks stored as the file keeps them and unpacked by standard ONNX operators that ONNX Runtime folds at load.

Checked on a tiny GGUF with Q4_K, Q6_K (layers and LM head) and a Q4_K token embedding, exported plain and packed:
the initializers of every MatMulNBits node and of the embedding lookup, unpacked by ONNX Runtime's folding (what a
C/C++/C# host gets) and by mirrorsd's own unpacking (devices/unpack.py, whole and in row chunks), equal the plain
folder's bit for bit; the packed folder is smaller; it generates the same tokens (every mode equal to ar); mirrorsd's
kernel takes the same nodes; OpenVINO (CPU, standing in for the NPU) runs a packed draft. Not checked here: CUDA and
DirectML sessions (mirrorsd hands every provider the same unpacked bytes) and a real NPU."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_gguf import write_gguf
from tiny_models import build_model

TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"}
ROLES = ("prefix", "exit_head", "suffix", "draft")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """{storage: export folder} of one tiny K-quant GGUF (hidden 256: K-quants need K % 256 == 0), both models int4,
    --gguf-blocks widen so that the Q6_K tensors are held at 8 bits (packed: from the file's own blocks)."""
    from mirrorsd.export.pipeline import ExportOptions, export

    base = tmp_path_factory.mktemp("packed")
    gguf = write_gguf(build_model(base / "hf", "qwen2", layers=2, hidden=256), base / "tiny-k6.gguf", TYPES)
    out = {}
    for storage in ("plain", "packed"):
        out[storage] = base / storage
        export(ExportOptions(model=gguf, output=out[storage], target_precision="int4", draft_precision="int4",
                             draft_layers=1, gguf_blocks="widen", weight_storage=storage))
    return out


def folded_initializers(path: Path) -> tuple[object, dict[str, np.ndarray]]:
    """The graph as ONNX Runtime sees it after constant folding (basic level), and its initializers by name."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(path.with_name(path.stem + ".folded.onnx"))
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    model = onnx.load(options.optimized_model_filepath)
    return model, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def weight_inputs(model, initializers: dict) -> list[str]:
    """Every MatMulNBits input but the activations, and every constant table a Gather reads (the embedding lookup's
    codes, byte values, scales and offsets)."""
    names = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            names += [n for n in node.input[1:] if n]
        elif node.op_type == "Gather" and node.input[0] in initializers:
            names.append(node.input[0])
    return names


@pytest.mark.parametrize("role", ROLES)
def test_folded_weights_equal_plain_storage_bit_for_bit(folders, role):
    import onnx

    stored = onnx.load(folders["packed"] / f"{role}.onnx", load_external_data=False)
    assert any(n.name.startswith("unpack/") for n in stored.graph.node), "nothing was packed"
    plain_model, plain = folded_initializers(folders["plain"] / f"{role}.onnx")
    packed_model, packed = folded_initializers(folders["packed"] / f"{role}.onnx")
    assert not any(n.name.startswith("unpack/") for n in packed_model.graph.node), "ONNX Runtime left some unfolded"
    names = weight_inputs(plain_model, plain)
    assert sorted(names) == sorted(weight_inputs(packed_model, packed))
    if role != "exit_head":  # carried Q4_K is among them (the exit head holds only the Q6_K LM head)
        assert any(n.endswith("_zero_points") for n in names)
    for name in names:
        a, b = plain[name], packed[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), f"{role}: {name} differs"


def test_packed_folder_is_smaller_and_records_its_storage(folders):
    sizes = {storage: sum(f.stat().st_size for f in folder.iterdir() if ".onnx" in f.name)
             for storage, folder in folders.items()}
    assert sizes["packed"] < 0.95 * sizes["plain"]
    manifests = {s: json.loads((f / "mirrorsd.json").read_text()) for s, f in folders.items()}
    assert manifests["packed"]["export_options"]["weight_storage"] == "packed"
    assert manifests["plain"]["export_options"]["weight_storage"] == "plain"
    for role in ROLES:  # the same carried and widened counts: packing changes where the numbers live, not them
        counts = {s: {k: v for k, v in m["graphs"][role]["validation"].items() if k.startswith(("gguf_", "embed"))}
                  for s, m in manifests.items()}
        assert counts["packed"] == counts["plain"], role
    assert any(k.startswith("gguf_widened.Q6_K") for k in manifests["packed"]["graphs"]["suffix"]["validation"])


def test_packed_folder_generates_the_plain_folder_s_tokens(folders):
    from mirrorsd.devices import kernels
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    which = "ort" if kernels.unavailable_reason() else "mirrorsd"
    prompts = ([1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42], [5, 6, 7, 8, 5, 6, 7])
    tokens = {}
    for storage, folder in folders.items():
        with Pipeline.load(folder, DeviceRequest(kernels=which)) as pipe:
            for prompt in prompts:
                for mode in ("ar", "sd", "mirror"):
                    tokens[storage, mode, tuple(prompt)] = pipe.generate(
                        prompt, GenerationConfig(mode=mode, max_new_tokens=20)).tokens
    for prompt in prompts:
        ar = tokens["plain", "ar", tuple(prompt)]
        for key in (("packed", "ar"), ("packed", "sd"), ("packed", "mirror"), ("plain", "sd")):
            assert tokens[(*key, tuple(prompt))] == ar, key


def test_mirrorsds_kernel_takes_the_same_nodes(folders):
    from mirrorsd.devices.kernels.rewrite import read_switched

    for role in ROLES:
        switched = {s: read_switched(folders[s] / f"{role}.onnx")[1] for s in folders}
        assert switched["packed"] == switched["plain"] > 0, role


@pytest.mark.parametrize("chunk_bytes", [None, 512])
def test_mirrorsds_unpacking_equals_plain_storage_bit_for_bit(folders, monkeypatch, chunk_bytes):
    """devices/unpack.py, which mirrorsd's sessions use instead of ONNX Runtime's folding: whole, and in chunks of a
    few rows (512 stored bytes: the widened head splits into dozens)."""
    import onnx
    from onnx import numpy_helper

    from mirrorsd.devices import unpack

    if chunk_bytes:
        monkeypatch.setattr(unpack, "CHUNK_BYTES", chunk_bytes)
    for role in ROLES:
        data = unpack.unpacked_bytes(folders["packed"] / f"{role}.onnx")
        model = onnx.load_from_string(data)
        assert not any(n.name.startswith("unpack/") for n in model.graph.node)
        plain = onnx.load(folders["plain"] / f"{role}.onnx")
        ours = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        theirs = {i.name: numpy_helper.to_array(i) for i in plain.graph.initializer}
        assert sorted(ours) == sorted(theirs), role  # nothing left over, nothing missing
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype and ours[name].tobytes() == value.tobytes(), f"{role}: {name}"
    assert unpack.unpacked_bytes(folders["plain"] / "suffix.onnx") is None  # a plain graph is opened as it is


def test_openvino_runs_a_packed_draft_from_the_unpacked_bytes(folders):
    """OpenVINO's reader refuses the packed file itself (its MatMulNBits needs constant zero points); mirrorsd hands
    it the unpacked graph. OpenVINO's CPU plugin stands in for the NPU here (no NPU on this machine)."""
    from mirrorsd.devices.openvino_import import load_openvino
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    ov = load_openvino()
    if "CPU" not in ov.Core().available_devices:
        pytest.skip("OpenVINO has no CPU device here")
    with pytest.raises(Exception):
        ov.Core().compile_model(str(folders["packed"] / "draft.onnx"), "CPU")
    from mirrorsd.devices import kernels

    if kernels.unavailable_reason():  # the int4 target's verification is exact with mirrorsd's kernel only
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    prompt = [1, 17, 42, 99, 7, 3, 3]
    with Pipeline.load(folders["plain"], DeviceRequest(kernels="mirrorsd")) as pipe:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=20)).tokens
    with Pipeline.load(folders["packed"], DeviceRequest(draft="openvino:CPU", kernels="mirrorsd")) as pipe:
        assert pipe.placements["draft"].backend == "openvino"
        for mode in ("sd", "mirror"):
            assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=20)).tokens == ar, mode


def test_a_packed_draft_vocabulary_cut_is_refused_before_any_work(tmp_path):
    from mirrorsd.errors import ExportOptionError
    from mirrorsd.export.pipeline import ExportOptions, export

    gguf = write_gguf(build_model(tmp_path / "hf", "qwen2", layers=2, hidden=256), tmp_path / "s.gguf", TYPES)
    with pytest.raises(ExportOptionError, match="--draft-weight-storage plain"):
        export(ExportOptions(model=gguf, output=tmp_path / "out", target_precision="int4", draft_layers=1,
                             draft_vocab=64, weight_storage="packed"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportOptionError, match="not a storage"):
        export(ExportOptions(model=gguf, output=tmp_path / "out", weight_storage="zip"))


def test_the_c_host_loads_packed_graphs_as_they_are(native_build, folders):
    """libmirrorsd (runtime/native) opens the files with ONNX Runtime, whose constant folding unpacks the weights
    (what any C/C++/C# host gets): its tokens equal the Python runtime's on the plain folder, ar and sd alike."""
    from mirrorsd.devices import kernels
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline
    from mirrorsd.runtime.native import NativeModel

    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    prompt = [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42]
    with Pipeline.load(folders["plain"], DeviceRequest(kernels="mirrorsd")) as pipe:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
    with NativeModel(folders["packed"], native_build.library, kernels="mirrorsd") as native:
        assert native.kernels == {"target": "mirrorsd", "draft": "mirrorsd"}
        assert native.generate(prompt, mode="ar", max_new_tokens=24).tokens == ar
        assert native.generate(prompt, mode="sd", max_new_tokens=24, gamma=4).tokens == ar


def test_the_bandwidth_ceiling_counts_what_a_session_holds(folders):
    """The bench's ceiling divides bandwidth by the bytes a decode step reads: a packed folder streams what the plain
    one does (its weights are unpacked at load), so both count the same bytes although the files differ."""
    from mirrorsd.apps.bandwidth import target_weight_bytes
    from mirrorsd.manifest import load_manifest

    counted = {s: target_weight_bytes(f, load_manifest(f)) for s, f in folders.items()}
    files = {s: sum((f / n).stat().st_size for n in ("prefix.onnx", "suffix.onnx")) for s, f in folders.items()}
    assert files["packed"] < files["plain"]
    assert abs(counted["packed"] - counted["plain"]) < 0.002 * counted["plain"]  # graph bytes: node lists differ


def test_mirrorsd_unpack_writes_the_plain_folder(folders, tmp_path):
    """`mirrorsd unpack` (for hosts that load the files themselves): every graph's initializers equal the plain
    export's, no unpacking node is left, the manifest says plain and where it came from; a plain source and an
    occupied output are refused before anything is written."""
    import onnx
    from onnx import numpy_helper

    from mirrorsd.apps.unpack_folder import unpack_folder
    from mirrorsd.errors import ExportOptionError, OutputFolderError

    out = unpack_folder(folders["packed"], tmp_path / "unpacked")
    manifest = json.loads((out / "mirrorsd.json").read_text())
    assert manifest["export_options"]["weight_storage"] == "plain"
    assert manifest["export_options"]["unpacked_from"] == str(folders["packed"].resolve())
    for role in ROLES:
        ours, theirs = onnx.load(out / f"{role}.onnx"), onnx.load(folders["plain"] / f"{role}.onnx")
        assert not any(n.name.startswith("unpack/") for n in ours.graph.node)
        a = {i.name: numpy_helper.to_array(i).tobytes() for i in ours.graph.initializer}
        b = {i.name: numpy_helper.to_array(i).tobytes() for i in theirs.graph.initializer}
        assert a == b, role
    assert (out / "tokenizer").is_dir()
    with pytest.raises(ExportOptionError, match="no packed weights"):
        unpack_folder(folders["plain"], tmp_path / "again")
    assert not (tmp_path / "again").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputFolderError):
        unpack_folder(folders["packed"], tmp_path / "mine", force=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_damaged_graphs_are_reported_by_what_opens_them(folders, tmp_path):
    """unpacked_bytes leaves an empty or non-ONNX file to the session that opens it (None: no packed weights seen),
    and a packed graph whose unpacking cannot run is one what/why/fix error naming the file."""
    from mirrorsd.devices.unpack import unpacked_bytes
    from mirrorsd.errors import GraphFileError

    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "noise.onnx").write_bytes(bytes(range(256)) * 4)
    assert unpacked_bytes(tmp_path / "empty.onnx") is None
    assert unpacked_bytes(tmp_path / "noise.onnx") is None
    data = (folders["packed"] / "draft.onnx").read_bytes()
    broken = tmp_path / "draft.onnx"
    broken.write_bytes(data.replace(b"ReduceMax", b"ReduceMix").replace(b"Mod", b"Mud"))
    with pytest.raises(GraphFileError, match="draft.onnx.*cannot be unpacked"):
        unpacked_bytes(broken)
