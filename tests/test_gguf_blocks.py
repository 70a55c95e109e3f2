"""Lossless GGUF import: a GGUF's Q4_0 / Q5_0 / Q8_0 blocks become MatMulNBits weights that ONNX Runtime dequantizes
bitwise to gguf's own dequantization, and its Q4_K blocks MatMulNBits weights with float zero points equal to it up
to float rounding; formats that do not map (Q4_1, Q5_K here) are requantized, and the manifest counts both. The files
are written by the ``gguf`` package (tests/tiny_gguf.py; K-quant blocks built there by hand) and exported for
real."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_gguf import LAYER_TENSORS, write_gguf
from tiny_models import build_model

TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_0", "ffn_down": "Q5_0", "output": "Q4_0", "token_embd": "Q8_0"}
# K-quants need K to be a multiple of 256: a wider model (hidden 256, intermediate 512)
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
           "ffn_up": "Q4_K", "ffn_down": "Q4_K", "output": "Q8_0", "token_embd": "Q8_0"}
CANNOT_SURVIVE = {("Q8_0", "int4"), ("Q5_0", "int4"), ("Q4_1", "int4"), ("Q4_1", "int8"), ("Q4_K", "int4"),
                  ("Q5_K", "int4")}
HF_TO_KIND = {part: kind for kind, part in LAYER_TENSORS.items()}
WIDENED = ("Q5_1", "Q5_K", "Q6_K")  # held at 8 bits in an int4 export under --gguf-blocks widen
MODES = ("exact", "widen", "requantize")
# Carried Q4_K weights may differ from gguf's by a few float32 roundings: zp = offset / s, c - zp, (c - zp) * s and
# gguf's own d*sc*q - dmin*m each round once, so |error| <= 4 * 2^-24 * (|dmin m| + 15 |d sc|) per block of 32
# (the block's magnitude; 4 units in the last place at most). ONNX Runtime's c*s - zp*s obeys the same bound.
ROUNDINGS = 4


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gguf")
    return write_gguf(build_model(base / "hf", "qwen2", layers=2), base / "tiny.gguf", TYPES)


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gguf-k")
    return write_gguf(build_model(base / "hf", "qwen2", layers=2, hidden=256), base / "tiny-k.gguf", K_TYPES)


def export_modes(source: Path, factory) -> dict[str, Path]:
    """{mode: export folder}: int4 target, int8 draft (the target's first layer)."""
    from mirrorsd.export.pipeline import ExportOptions, export

    out = {}
    for mode in MODES:
        folder = factory.mktemp(mode) / "out"
        export(ExportOptions(model=source, output=folder, target_precision="int4", draft_precision="int8",
                             draft_layers=1, gguf_blocks=mode))
        out[mode] = folder
    return out


@pytest.fixture(scope="module")
def exports(tiny_gguf, tmp_path_factory):
    return export_modes(tiny_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def k_exports(k_gguf, tmp_path_factory):
    return export_modes(k_gguf, tmp_path_factory)


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


def nbits_nodes(graph_file: Path) -> dict[str, tuple[int, np.ndarray, np.ndarray, bool]]:
    """Model parameter -> (bits, the weight [K, N] ONNX Runtime computes with, the weight [N, K] dequantized from the
    node's initializers as MatMulNBits defines it, whether it has float zero points), for every MatMulNBits node.
    ONNX Runtime's: the node run alone on an identity matrix in float32 (accuracy level 1), so its output is the
    dequantized weight (up to the sign of zeros, which a sum of products does not keep)."""
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
        assert len(node.input) in (3, 4), "no g_idx, no bias"
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
        packed, scales, *zero_points = (numpy_helper.to_array(inits[name]) for name in node.input[1:])
        if zero_points:
            assert zero_points[0].dtype == np.float32 and zero_points[0].shape == (scales.size,)
        found[parameter] = (attrs["bits"], session.run(None, {"a": np.eye(k, dtype=np.float32)})[0],
                            dequantize_nbits(packed, scales, attrs["bits"], *zero_points), bool(zero_points))
    return found


def carried_as(mode: str, precision: str, kind: str) -> int | None:
    """The bit width a GGUF type is carried at, or None when it is requantized (gguf_blocks.py's table)."""
    maps = {"Q4_0": (4, 8), "Q5_0": (8,), "Q8_0": (8,), "Q4_K": (4,)}.get(kind, ())
    bits = {"int4": 4, "int8": 8}[precision]
    if mode == "requantize":
        return None
    if bits in maps:
        return bits
    return 8 if mode == "widen" and 8 in maps else None


def block_magnitude(path: Path, name: str) -> np.ndarray:
    """|dmin m_j| + 15 |d sc_j| of each sub-block of 32 of the Q4_K tensor ``name`` [N, K/32], read by the module
    under test's k_quant_parts (test_k_quant_parts_are_gguf_s_blocks checks it against gguf)."""
    from gguf import GGUFReader

    from mirrorsd.export.gguf_blocks import k_quant_parts

    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    n = int(tensor.shape[-1])
    _, scales, offsets = k_quant_parts(np.asarray(tensor.data).reshape(n, -1, 144), "Q4_K")
    return np.abs(offsets) + 15 * np.abs(scales)


def check_export(folder: Path, source_path: Path, mode: str) -> None:
    """Every MatMulNBits weight of every graph: carried ones equal the GGUF's (bitwise, or within ROUNDINGS for
    Q4_K), in the node's initializers and in what ONNX Runtime computes; requantized ones have the export's width;
    the manifest's counts match."""
    from mirrorsd import names

    source = gguf_weights(source_path)
    manifest = json.loads((folder / "mirrorsd.json").read_text())
    assert manifest["export_options"]["gguf_blocks"] == mode
    for role, precision in ((names.PREFIX, "int4"), (names.SUFFIX, "int4"), (names.DRAFT, "int8")):
        expected_counts: dict[str, float] = {}
        nodes = nbits_nodes(folder / names.graph_file(role))
        assert nodes, f"{role} has MatMulNBits nodes"
        for parameter, (bits, computed, defined, has_zero_points) in nodes.items():
            kind, reference = source[gguf_name(parameter)]
            carried = carried_as(mode, precision, kind)
            bitwise = np.array_equal(defined.view(np.uint32), reference.view(np.uint32))
            assert has_zero_points == (carried is not None and kind == "Q4_K"), f"{role} {parameter} ({kind})"
            if carried and kind == "Q4_K":  # float zero points: equal up to float rounding
                bound = ROUNDINGS * 2.0**-24 * np.repeat(block_magnitude(source_path, gguf_name(parameter)), 32, 1)
                assert bits == carried
                assert np.all(np.abs(defined - reference) <= bound), f"{role} {parameter}"
                assert np.all(np.abs(computed.T - reference) <= bound), f"ONNX Runtime computes with {parameter}"
            elif carried:
                assert bits == carried and bitwise, f"{role} {parameter} ({kind}) must be the GGUF's blocks"
                assert np.array_equal(computed.T, reference), f"ONNX Runtime computes with {parameter} as stored"
            elif not (mode == "widen" and precision == "int4" and kind in WIDENED):
                # requantized: a block whose grid is a sub-grid of the new one re-rounds to itself (Q4_0 with a -8d
                # extreme), so only wider grids or float offsets must differ
                assert bits == {"int4": 4, "int8": 8}[precision], f"{role} {parameter} ({kind})"
                if (kind, precision) in CANNOT_SURVIVE:
                    assert not bitwise, f"{role} {parameter} ({kind}) cannot survive requantizing to {precision}"
            widened = not carried and mode == "widen" and precision == "int4" and kind in WIDENED
            if widened:  # 8-bit round-to-nearest of the file's values: within half a step of the block's scale
                step = np.repeat(np.abs(reference).reshape(reference.shape[0], -1, 32).max(-1) / 127, 32, 1)
                assert bits == 8 and np.all(np.abs(defined - reference) <= 0.5 * step * (1 + 1e-6)), parameter
            key = f"gguf_{'carried' if carried else 'widened' if widened else 'requantized'}.{kind}"
            expected_counts[key] = expected_counts.get(key, 0) + 1
        validation = manifest["graphs"][role]["validation"]
        assert {k: v for k, v in validation.items() if k.startswith("gguf_")} == expected_counts


@pytest.mark.parametrize("mode", MODES)
def test_carried_blocks_dequantize_bitwise_to_gguf(exports, tiny_gguf, mode):
    check_export(exports[mode], tiny_gguf, mode)


@pytest.mark.parametrize("mode", MODES)
def test_carried_q4_k_blocks_equal_gguf_up_to_float_rounding(k_exports, k_gguf, mode):
    check_export(k_exports[mode], k_gguf, mode)
    counts = json.loads((k_exports[mode] / "mirrorsd.json").read_text())["graphs"]["suffix"]["validation"]
    assert counts.get("gguf_carried.Q4_K", 0) == (0 if mode == "requantize" else 6)  # q, k, o, gate, up, down
    assert counts[f"gguf_{'widened' if mode == 'widen' else 'requantized'}.Q5_K"] == 1  # widen: at 8 bits


def test_a_folder_converted_from_a_gguf_carries_the_file_s_blocks(k_gguf, tmp_path):
    """The pinned demo models export from the Hugging Face folder `mirrorsd fetch` converted: the blocks come from
    the GGUF it names (still in the cache), so the export equals one made from the GGUF itself; a folder weight
    edited since the conversion is not the file's, so it is requantized from the folder."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from mirrorsd.export.convert import gguf_to_hf_folder
    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.runtime import GenerationConfig, Pipeline

    cached = tmp_path / "cache" / "gguf" / k_gguf.name
    cached.parent.mkdir(parents=True)
    shutil.copy(k_gguf, cached)
    folder = gguf_to_hf_folder(cached, tmp_path / "cache" / "hf" / "tiny-k", progress=False)

    def counts(source, name):
        out = tmp_path / name
        export(ExportOptions(model=source, output=out, target_precision="int4", draft_precision="int8",
                             draft_layers=1, gguf_blocks="widen"))
        return out, json.loads((out / "mirrorsd.json").read_text())["graphs"]["suffix"]["validation"]

    linked, linked_counts = counts(folder, "linked")
    _, direct_counts = counts(k_gguf, "direct")
    gguf_counts = {k: v for k, v in linked_counts.items() if k.startswith("gguf_")}
    assert gguf_counts == {k: v for k, v in direct_counts.items() if k.startswith("gguf_")}
    assert gguf_counts["gguf_carried.Q4_K"] == 6 and gguf_counts["gguf_widened.Q5_K"] == 1
    with Pipeline.load(linked) as pipe:
        ar = pipe.generate([5, 6, 7, 8], GenerationConfig(mode="ar", max_new_tokens=24)).tokens
        assert pipe.generate([5, 6, 7, 8], GenerationConfig(mode="sd", max_new_tokens=24)).tokens == ar
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(str(shard))
    edited = next(n for n in tensors if n.endswith("layers.1.self_attn.q_proj.weight"))
    tensors[edited] = tensors[edited] * np.float32(1.5)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _, edited_counts = counts(folder, "edited")
    assert edited_counts["gguf_differs.Q4_K"] == 1 and edited_counts["gguf_carried.Q4_K"] == 5


@pytest.mark.parametrize("kind, block_bytes", [("Q4_K", 144), ("Q5_K", 176)])
def test_k_quant_parts_are_gguf_s_blocks(kind, block_bytes):
    """Random bytes (every bit pattern of the packed 6-bit scales, random codes) under random finite fp16 d and
    dmin of either sign: scale * q - offset is gguf's dequantization bitwise, and the zero-point form within
    ROUNDINGS; sub-blocks of scale 0 (with and without an offset) included."""
    from gguf import GGMLQuantizationType, dequantize

    from mirrorsd.export.gguf_blocks import dequantize_nbits, k_quant_parts, pack, with_zero_points

    rng = np.random.default_rng(3)
    n, nb = 64, 4
    raw = rng.integers(0, 256, size=(n, nb, block_bytes), dtype=np.uint8)
    d = (rng.standard_normal((n, nb, 2)) * np.exp2(rng.integers(-14, 4, (n, nb, 2)))).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(n, nb, 4)
    raw[0, 0, 4] &= 0xC0  # sub-block 0 of the first block: sc = 0 (its m is random)
    raw[0, 0, [5, 9]] &= 0xC0  # sub-block 1: sc = 0 and m = 0
    reference = dequantize(raw.reshape(n, -1), GGMLQuantizationType[kind])  # [N, K]
    q, scales, offsets = k_quant_parts(raw, kind)
    assert q.max() == (15 if kind == "Q4_K" else 31)
    product = scales[..., None] * q.astype(np.float32) - offsets[..., None]
    assert np.array_equal(product.reshape(n, -1), reference)
    codes, s, zero_points = with_zero_points(q, scales, offsets)
    assert scales[0, 0] == 0 and offsets[0, 0] != 0 and scales[0, 1] == 0 and offsets[0, 1] == 0
    bits = 4 if kind == "Q4_K" else 8
    defined = dequantize_nbits(pack(codes, bits), s, bits, zero_points)
    magnitude = np.abs(offsets) + int(q.max()) * np.abs(scales)
    error = np.abs(defined - reference).reshape(n, -1, 32).max(axis=-1)
    assert np.all(error <= ROUNDINGS * 2.0**-24 * magnitude)
    assert np.array_equal(defined[0, :64], reference[0, :64])  # the constant and the zero sub-block: exact


def test_onnx_runtime_refuses_8_bit_float_zero_points():
    """Why Q5_K (8-bit codes with a float zero point) is requantized: ONNX Runtime's CPU MatMulNBits refuses such a
    node, so export validation and hosts without mirrorsd's kernels could not load it. When this fails, ONNX Runtime
    took them: Q5_K could be carried at 8 bits under --gguf-blocks widen."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    k, n = 32, 4
    inits = [numpy_helper.from_array(np.zeros((n, 1, 32), np.uint8), "B"),
             numpy_helper.from_array(np.ones(n, np.float32), "S"), numpy_helper.from_array(np.ones(n, np.float32), "Z")]
    node = helper.make_node("MatMulNBits", ["a", "B", "S", "Z"], ["y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=32)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.log_severity_level = 4
    with pytest.raises(Exception, match="(?i)zero point"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_ar_on_a_k_quant_export(k_exports, mode):
    """sd and mirror reproduce ar token for token with mirrorsd's kernel, which runs the carried Q4_K weights
    (float zero points) row-invariantly."""
    from mirrorsd.devices import kernels
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    with Pipeline.load(k_exports[mode], DeviceRequest(kernels="mirrorsd")) as pipe:
        assert pipe.placements["suffix"].kernels == "mirrorsd"
        for prompt in ([1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42]):
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
            assert ar, "ar generated tokens"
            for decoding in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=decoding, max_new_tokens=24)).tokens == ar


@pytest.mark.parametrize("source", ["exports", "k_exports"])
def test_carrying_is_at_least_as_close_to_the_source(source, request):
    """Fewer second roundings: the quantized target moves less from the (dequantized) GGUF model."""
    exports = request.getfixturevalue(source)

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


@pytest.mark.parametrize("mode", ["exact", "requantize"])
def test_onnx_runtimes_kernel_is_checked_on_float_zero_points(k_exports, mode):
    """With ONNX Runtime's own kernel, a target carrying float zero points is checked on that path too: sd/mirror
    are refused where it is not row-invariant (it was not on the CPUs tried), else they emit ar's tokens."""
    from mirrorsd import names
    from mirrorsd.devices.ort_kernel_check import target_kernel_difference
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.errors import GenerationInputError
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    manifest = load_manifest(k_exports[mode])
    carried = manifest.graph(names.SUFFIX).validation.get(names.FLOAT_ZERO_POINT_WEIGHTS, 0)
    assert carried == (6 if mode == "exact" else 0)
    difference, paths = target_kernel_difference(manifest)
    assert ("float zero points" in paths) == (mode == "exact")
    prompt = [1, 17, 42, 99, 7]
    with Pipeline.load(k_exports[mode], DeviceRequest(kernels="ort")) as pipe:
        assert pipe.placements["suffix"].kernels == "ort"
        if difference > 0.0:
            assert paths in pipe.inexact_windows()
            with pytest.raises(GenerationInputError, match="would not reproduce"):
                pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=4))
        else:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=16)).tokens
            assert pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=16)).tokens == ar


def test_the_c_host_runs_carried_q4_k_with_mirrorsds_kernel(native_build, k_exports):
    """libmirrorsd (runtime/native) loads mirrorsd's kernels in replace mode, so every MatMulNBits node, float zero
    points included, runs there: C ar equals the Python runtime's ar and C sd emits C ar's tokens. Without the
    kernels (ONNX Runtime's own) the C host applies the same float-zero-point check as Python."""
    from mirrorsd.devices import kernels
    from mirrorsd.devices.ort_kernel_check import target_kernel_difference
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime import GenerationConfig, Pipeline
    from mirrorsd.runtime.native import NativeModel

    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    folder, prompt = k_exports["exact"], [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42]
    with NativeModel(folder, native_build.library, kernels="mirrorsd") as native, \
            Pipeline.load(folder, DeviceRequest(kernels="mirrorsd", target_kv_in_place=False)) as pipe:
        assert native.kernels == {"target": "mirrorsd", "draft": "mirrorsd"} and native.inexact_windows() == ""
        c_ar = native.generate(prompt, mode="ar", max_new_tokens=24)
        assert c_ar.tokens == pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
        assert native.generate(prompt, mode="sd", max_new_tokens=24, gamma=4).tokens == c_ar.tokens
    difference, paths = target_kernel_difference(load_manifest(folder))
    with NativeModel(folder, native_build.library, kernels="ort") as native:
        assert native.kernels["target"] == "ort"
        assert (paths in native.inexact_windows()) == (difference > 0.0)


def test_the_draft_can_take_another_mode_than_the_target(k_gguf, tmp_path):
    """--gguf-blocks widen --draft-gguf-blocks exact: the target keeps Q5_K at 8 bits, the draft requantizes it to
    4 (a smaller, faster draft; the target checks its tokens), and the manifest records both modes."""
    from mirrorsd.export.pipeline import ExportOptions, export

    out = tmp_path / "out"
    export(ExportOptions(model=k_gguf, output=out, target_precision="int4", draft_precision="int4", draft_layers=1,
                         gguf_blocks="widen", draft_gguf_blocks="exact"))
    manifest = json.loads((out / "mirrorsd.json").read_text())
    assert (manifest["export_options"]["gguf_blocks"], manifest["export_options"]["draft_gguf_blocks"]) == \
        ("widen", "exact")
    suffix, draft = (manifest["graphs"][role]["validation"] for role in ("suffix", "draft"))
    assert suffix["gguf_widened.Q5_K"] == 1 and "gguf_requantized.Q5_K" not in suffix
    assert draft["gguf_requantized.Q5_K"] == 1 and not any(k.startswith("gguf_widened") for k in draft)
    assert draft["gguf_carried.Q4_K"] == 6  # the draft's one layer: q, k, o, gate, up, down


def test_onnx_runtimes_kernel_on_float_zero_points_is_warned_about(k_exports):
    """Carried Q4_K weights run tens of times slower on ONNX Runtime's own kernel: loading such an export with
    --kernels ort says so and what to do; with mirrorsd's kernel, or a requantized export, nothing is said."""
    import warnings

    from mirrorsd.devices.kernel_choice import SlowKernelWarning, slow_weights_note
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime import Pipeline

    with pytest.warns(SlowKernelWarning, match="float zero points.*--gguf-blocks requantize"):
        Pipeline.load(k_exports["exact"], DeviceRequest(kernels="ort")).close()
    assert slow_weights_note(load_manifest(k_exports["exact"]), "mirrorsd") == ""
    assert slow_weights_note(load_manifest(k_exports["requantize"]), "ort") == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowKernelWarning)
        Pipeline.load(k_exports["requantize"], DeviceRequest(kernels="ort")).close()


def test_widen_head_holds_only_the_logits_head_at_8_bits(tmp_path_factory):
    """--gguf-blocks widen-head: the LM head of the graph that makes the target's logits (suffix) is held at 8 bits
    as widen holds it; every other tensor (another Q5_K, the exit head's copy of the head, the draft's head even
    under the same mode) is treated as exact treats it, and the manifest counts each; sd and mirror stay exact."""
    from mirrorsd.devices import kernels
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.runtime import GenerationConfig, Pipeline

    base = tmp_path_factory.mktemp("gguf-head")
    gguf = write_gguf(build_model(base / "hf", "qwen2", layers=2, hidden=256), base / "head-k.gguf",
                      {**K_TYPES, "output": "Q5_K"})
    out = base / "out"
    export(ExportOptions(model=gguf, output=out, target_precision="int4", draft_precision="int4", draft_layers=1,
                         gguf_blocks="widen-head"))
    manifest = json.loads((out / "mirrorsd.json").read_text())
    assert manifest["export_options"]["gguf_blocks"] == "widen-head"
    counts = {role: {k: v for k, v in manifest["graphs"][role]["validation"].items() if k.startswith("gguf_")}
              for role in ("suffix", "exit_head", "draft")}
    assert counts["suffix"]["gguf_widened.Q5_K"] == 1  # the head
    assert counts["suffix"]["gguf_requantized.Q5_K"] == 1  # layer 1's v projection stays at 4 bits
    assert "gguf_widened.Q5_K" not in counts["exit_head"] and counts["exit_head"]["gguf_requantized.Q5_K"] == 1
    assert not any(k.startswith("gguf_widened") for k in counts["draft"])
    source = gguf_weights(gguf)
    for role, head_bits in (("suffix", 8), ("exit_head", 4), ("draft", 4)):
        for parameter, (bits, _, defined, _) in nbits_nodes(out / f"{role}.onnx").items():
            is_head = parameter == "lm_head.weight"
            assert bits == (head_bits if is_head else 4), f"{role} {parameter}"
            if is_head and bits == 8:  # 8-bit round-to-nearest of the file's values, as widen does
                reference = source[gguf_name(parameter)][1]
                step = np.repeat(np.abs(reference).reshape(reference.shape[0], -1, 32).max(-1) / 127, 32, 1)
                assert np.all(np.abs(defined - reference) <= 0.5 * step * (1 + 1e-6))
    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    with Pipeline.load(out, DeviceRequest(kernels="mirrorsd")) as pipe:
        for prompt in ([1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42]):
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
            for decoding in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=decoding, max_new_tokens=24)).tokens == ar
