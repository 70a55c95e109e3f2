"""Routing a graph's MatMulNBits nodes to mirrorsd's kernel: the in-place domain rewrite (inline and external data,
back and forth), the replace mode on an unchanged graph, and the runtime glue in a process without onnx or torch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from kernel_graphs import library_or_skip, model_bytes, open_session, random_layers, run

from mirrorsd.errors import GraphFileError
from mirrorsd.devices import kernels

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def lib():
    return library_or_skip()


@pytest.fixture(scope="module")
def layers():
    return random_layers(np.random.default_rng(5), [200, 1000, 100], 4, bias=True)


def test_switch_routes_every_node_to_the_kernel_and_back(lib, layers, monkeypatch):
    a = np.random.default_rng(1).standard_normal((5, 200)).astype(np.float32)
    original = model_bytes(layers, kernels.ORT_DOMAIN, accuracy_level=0)  # ORT's fp32 kernel: other bits than ours
    direct = run(open_session(model_bytes(layers, kernels.DOMAIN), monkeypatch), a)
    switched = bytearray(original)
    assert kernels.switch_domain(switched) == 2
    assert len(switched) > len(original)  # the opset_import for mirrorsd.kern was appended
    np.testing.assert_array_equal(run(open_session(bytes(switched), monkeypatch), a), direct)
    back = bytearray(switched)
    assert kernels.switch_domain(back, kernels.ORT_DOMAIN) == 2
    assert bytes(back[:len(original)]) == original  # only the appended opset_import remains
    ort_kernel = ort.InferenceSession(original, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(run(ort.InferenceSession(bytes(back), providers=["CPUExecutionProvider"]), a),
                                  run(ort_kernel, a))
    assert not np.array_equal(run(ort_kernel, a), direct)  # so the comparisons above can tell the kernels apart


def test_replace_mode_runs_the_kernel_on_an_unchanged_graph(lib, layers, monkeypatch):
    a = np.random.default_rng(2).standard_normal((5, 200)).astype(np.float32)
    direct = run(open_session(model_bytes(layers, kernels.DOMAIN), monkeypatch), a)
    original = model_bytes(layers, kernels.ORT_DOMAIN, accuracy_level=0)
    np.testing.assert_array_equal(run(open_session(original, monkeypatch, replace=True), a), direct)
    assert not np.array_equal(run(open_session(original, monkeypatch, replace=False), a), direct)


def test_nodes_the_kernel_refuses_keep_onnx_runtimes_kernel():
    layers = random_layers(np.random.default_rng(3), [64, 32], 4)
    for tweak in ({"zero_points": True}, {"extra_attributes": {"block_size": 64}}, {"extra_attributes": {"bits": 2}}):
        model = model_bytes(layers, kernels.ORT_DOMAIN, **tweak)
        edited = bytearray(model)
        assert kernels.switch_domain(edited) == 0 and bytes(edited) == model


def test_float_zero_points_are_switched_and_packed_uint8_ones_are_not(lib, monkeypatch):
    layers = random_layers(np.random.default_rng(6), [200, 1000, 100], 4, bias=True, zero_points=True)
    a = np.random.default_rng(7).standard_normal((5, 200)).astype(np.float32)
    direct = run(open_session(model_bytes(layers, kernels.DOMAIN), monkeypatch), a)
    switched = bytearray(model_bytes(layers, kernels.ORT_DOMAIN))
    assert kernels.switch_domain(switched) == 2
    np.testing.assert_array_equal(run(open_session(bytes(switched), monkeypatch), a), direct)
    packed = model_bytes(random_layers(np.random.default_rng(6), [64, 32], 4), kernels.ORT_DOMAIN, zero_points=True)
    assert kernels.switch_domain(bytearray(packed)) == 0


def test_graph_from_onnx_runtimes_quantizer_with_external_data(lib, tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(4)
    w1, w2 = (rng.standard_normal((256, 192)) * 0.05).astype(np.float32), \
        (rng.standard_normal((192, 64)) * 0.05).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W1"], ["H"]), helper.make_node("MatMul", ["H", "W2"], ["Y"])], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", 256])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", 64])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    quantizer = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), bits=4,
                                     block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    path = tmp_path / "model.onnx"
    onnx.save_model(quantizer.model.model, str(path), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=0)
    data, count = kernels.read_switched(path)
    assert count == 2
    a = rng.standard_normal((5, 256)).astype(np.float32)
    ours = run(open_session(data, monkeypatch, config=kernels.external_data_config(path)), a)
    replaced = run(open_session(str(path), monkeypatch, replace=True), a)
    np.testing.assert_array_equal(ours, replaced)
    session = open_session(data, monkeypatch, config=kernels.external_data_config(path))
    alone = np.concatenate([run(session, a[i:i + 1]) for i in range(5)])
    np.testing.assert_array_equal(ours, alone)
    level4 = run(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), a)
    assert np.abs(ours - level4).max() < 1e-3 * np.abs(level4).max()  # the same int8-activation numerics


def test_damaged_bytes_raise_a_graph_file_error():
    model = bytearray(model_bytes(random_layers(np.random.default_rng(0), [64, 32], 4), kernels.ORT_DOMAIN))
    with pytest.raises(GraphFileError, match="not a valid ONNX model"):
        kernels.switch_domain(model[: len(model) // 2])


def test_kernel_glue_runs_without_onnx_or_torch(lib, tmp_path):
    layers = random_layers(np.random.default_rng(6), [96, 64], 4)
    path = tmp_path / "m.onnx"
    path.write_bytes(model_bytes(layers, kernels.ORT_DOMAIN))
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript'):
            raise ImportError(name + ' is blocked')
sys.meta_path.insert(0, Block())
import numpy as np, onnxruntime as ort
from mirrorsd.devices import kernels
data, count = kernels.read_switched({str(path)!r})
opts = ort.SessionOptions()
kernels.register(opts, allow_slow=True)
session = ort.InferenceSession(data, opts, providers=['CPUExecutionProvider'])
y = session.run(None, {{'A': np.ones((2, 96), np.float32)}})[0]
print(count, y.shape)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "(2,", "64)"]


@pytest.mark.parametrize("tweak", [{"zero_points": True}, {"extra_attributes": {"block_size": 64}}],
                         ids=["uint8-zero-points", "block-64"])
def test_a_node_the_kernel_refuses_is_a_clear_error_not_a_damaged_file(lib, tmp_path, tweak):
    """The runtime runs mirrorsd's kernel for every MatMulNBits node (replace mode); a valid graph in a layout it
    does not take must say so and name the way out (--kernels ort), not call the file damaged."""
    from mirrorsd.devices.backends import OrtSession, SessionSettings

    path = tmp_path / "layout.onnx"
    path.write_bytes(model_bytes(random_layers(np.random.default_rng(3), [64, 32], 4), kernels.ORT_DOMAIN, **tweak))
    with pytest.raises(GraphFileError) as caught:
        OrtSession(path, SessionSettings(kernels="mirrorsd"))
    text = str(caught.value)
    assert "mirrorsd's MatMulNBits kernel cannot run a node of 'layout.onnx'" in text
    assert "mm0" in text and "--kernels ort" in text and "damaged" not in text
