"""mirrorsd's fused decoding attention (devices/kernels/src/attention.cpp) and the rewrite that puts it into the
draft's graph (devices/kernels/attention_rewrite.py): the op against a float64 numpy reference on both of its paths
(AVX2 for head sizes that are multiples of 8, plain C++ otherwise), every row computed alone, the rewrite on a real
int4 export (every layer fused, the same logits within float rounding), graphs it must leave alone, and the pipeline
(only the draft fused, every mode still equal to ar)."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_graphs import library_or_skip

from mirrorsd.devices import kernels
from mirrorsd.devices.kernels.attention_rewrite import OP_TYPE, fuse_attention
from mirrorsd.devices.placement import FUSED_ATTENTION_MARK, DeviceRequest
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.runtime import GenerationConfig, Pipeline

from tiny_models import build_model

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
MASKED = float(np.finfo(np.float32).min)  # what the exported graphs add at masked slots


@pytest.fixture(scope="module")
def lib():
    return library_or_skip()


def attention_session(heads: int, kv_heads: int, scale: float, threads: int = 1):
    from onnx import TensorProto, helper

    names_in = ["q", "k", "v", "cos", "sin", "mask", "past_k", "past_v"]
    node = helper.make_node(OP_TYPE, names_in, ["y", "present_k", "present_v"], domain=kernels.DOMAIN,
                            num_heads=heads, kv_num_heads=kv_heads, scale=scale)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                    for n in names_in],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                               for n in ("y", "present_k", "present_v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    kernels.register(opts, allow_slow=True)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def random_inputs(rng, batch, seq, past, heads, kv_heads, dim):
    angles = rng.uniform(0, 6, (batch, seq, dim // 2))
    mask = np.zeros((batch, 1, seq, past + seq), np.float32)
    for s in range(seq):
        mask[:, :, s, past + s + 1:] = MASKED  # causal within the window
    if past > 4:
        mask[1, :, :, :3] = MASKED  # left padding of the second row
        mask[0, :, :, 4] = MASKED  # a hole (a branch slot not taken)
    return {"q": rng.standard_normal((batch, seq, heads * dim)).astype(np.float32),
            "k": rng.standard_normal((batch, seq, kv_heads * dim)).astype(np.float32),
            "v": rng.standard_normal((batch, seq, kv_heads * dim)).astype(np.float32),
            "cos": np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32),
            "sin": np.concatenate([np.sin(angles)] * 2, -1).astype(np.float32),
            "mask": mask,
            "past_k": rng.standard_normal((batch, kv_heads, past, dim)).astype(np.float32),
            "past_v": rng.standard_normal((batch, kv_heads, past, dim)).astype(np.float32)}


def reference(f, heads, kv_heads, scale):
    """transformers' eager attention with rotate_half rotary and repeat_kv, in float64."""
    batch, seq, _ = f["q"].shape
    dim = f["past_k"].shape[-1]

    def rotary(x, count):  # [B, S, count * D] -> [B, count, S, D]
        x = x.astype(np.float64).reshape(batch, seq, count, dim).transpose(0, 2, 1, 3)
        cos, sin = f["cos"][:, None].astype(np.float64), f["sin"][:, None].astype(np.float64)
        half = np.concatenate([-x[..., dim // 2:], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    keys = np.concatenate([f["past_k"], rotary(f["k"], kv_heads)], 2)
    values = np.concatenate([f["past_v"], f["v"].reshape(batch, seq, kv_heads, dim).transpose(0, 2, 1, 3)], 2)
    group = heads // kv_heads
    scores = rotary(f["q"], heads) @ np.repeat(keys, group, 1).transpose(0, 1, 3, 2) * scale + f["mask"]
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    y = (weights @ np.repeat(values, group, 1)).transpose(0, 2, 1, 3).reshape(batch, seq, heads * dim)
    return y, keys, values


@pytest.mark.parametrize("dim", [16, 12])  # 16: the AVX2 path where the CPU has it; 12: the plain one
@pytest.mark.parametrize("past", [0, 7])
def test_the_op_is_eager_grouped_attention_with_rotary(lib, dim, past):
    heads, kv_heads, scale = 4, 2, dim ** -0.5
    f = random_inputs(np.random.default_rng(dim + past), 2, 3, past, heads, kv_heads, dim)
    y, present_k, present_v = attention_session(heads, kv_heads, scale, threads=2).run(None, f)
    want_y, want_k, want_v = reference(f, heads, kv_heads, scale)
    np.testing.assert_array_equal(present_k[:, :, :past], f["past_k"])  # the past is copied, not recomputed
    np.testing.assert_array_equal(present_v, want_v.astype(np.float32))
    np.testing.assert_allclose(present_k, want_k, rtol=1e-5, atol=1e-5)
    valid = np.ones((2, 3), bool)  # every query row has at least one unmasked slot here
    np.testing.assert_allclose(y[valid], want_y[valid], rtol=1e-4, atol=1e-5)


def test_each_row_is_computed_alone(lib):
    """A window's row is bitwise the row computed by itself on the cache before it (its later slots masked)."""
    heads, kv_heads, dim, past, seq = 4, 2, 16, 9, 4
    f = random_inputs(np.random.default_rng(3), 2, seq, past, heads, kv_heads, dim)
    session = attention_session(heads, kv_heads, dim ** -0.5, threads=2)
    window, present_k, present_v = session.run(None, f)
    for s in range(seq):
        alone = {"q": f["q"][:, s:s + 1], "k": f["k"][:, s:s + 1], "v": f["v"][:, s:s + 1],
                 "cos": f["cos"][:, s:s + 1], "sin": f["sin"][:, s:s + 1],
                 "mask": f["mask"][:, :, s:s + 1, :past + s + 1],
                 "past_k": present_k[:, :, :past + s], "past_v": present_v[:, :, :past + s]}
        np.testing.assert_array_equal(session.run(None, alone)[0], window[:, s:s + 1])


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    source = build_model(tmp_path_factory.mktemp("fused-src"), "qwen2", layers=3, hidden=256, heads=8, kv_heads=2)
    out = tmp_path_factory.mktemp("fused") / "q"
    export(ExportOptions(model=source, output=out, draft_layers=2, target_precision="int4", draft_precision="int4"))
    return out


def run_graph(model, feeds):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    kernels.register(opts, replace=True, allow_slow=True)
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))


def draft_feeds(rng, batch, seq, past, layers):
    ids = rng.integers(0, 200, (batch, seq))
    mask = np.ones((batch, past + seq), np.int64)
    mask[1, :2] = 0
    positions = np.maximum(np.cumsum(mask, 1)[:, past:] - 1, 0)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    for layer in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal((batch, 2, past, 32)).astype(np.float32)
    return feeds


def test_the_rewrite_fuses_every_layer_of_an_exported_draft(lib, int4_export):
    original = (int4_export / "draft.onnx").read_bytes()
    fused, count = fuse_attention(original)
    assert count == 2
    nodes = onnx.load_from_string(fused).graph.node
    assert sum(n.op_type == OP_TYPE for n in nodes) == 2
    assert not any(n.op_type in ("Softmax", "Neg") for n in nodes)  # the eager attention's nodes are gone
    assert len(nodes) < len(onnx.load_from_string(original).graph.node) - 2 * 20
    for past, seq in ((0, 5), (6, 1), (6, 3)):
        feeds = draft_feeds(np.random.default_rng(past + seq), 2, seq, past, 2)
        want, got = run_graph(original, feeds), run_graph(fused, feeds)
        assert want.keys() == got.keys()
        for name in want:
            # float rounding apart (2e-7 of the largest value here); the next MatMulNBits quantizes its input to
            # int8, where such a difference can cross a rounding boundary, hence the margin
            np.testing.assert_allclose(got[name], want[name], atol=1e-3 * float(np.abs(want[name]).max()))


def test_graphs_without_that_attention_are_left_alone(lib, int4_export):
    head = (int4_export / "exit_head.onnx").read_bytes()  # norm + LM head: no attention at all
    assert fuse_attention(head) == (head, 0)
    assert fuse_attention(b"") == (b"", 0)


def test_the_pipeline_fuses_only_the_draft_and_every_mode_equals_ar(lib, int4_export):
    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    prompt = [1, 17, 42, 99, 7, 3, 3]
    # (by default the draft's cache is written in place, tests/test_kv_in_place.py; off, its attention is fused)
    with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", draft_kv_in_place=False)) as pipe:
        assert pipe.placements["draft"].fused_attention == 2
        assert FUSED_ATTENTION_MARK in pipe.placements["draft"].describe()
        assert all(pipe.placements[role].fused_attention == 0 for role in ("prefix", "suffix", "exit_head"))
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
        for mode in ("sd", "mirror"):
            assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=24)).tokens == ar
    with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", fused_draft_attention=False,
                                                  draft_kv_in_place=False)) as pipe:
        assert pipe.placements["draft"].fused_attention == 0 and pipe.placements["draft"].kv_in_place == 0
        assert pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=24)).tokens == ar


def test_the_rewrite_needs_neither_onnx_nor_torch(lib, int4_export):
    """The runtime installs without onnx: the rewrite reads and writes the graph with mirrorsd's own wire helpers."""
    import subprocess
    import sys

    from test_runtime_without_torch import BLOCK_TORCH

    code = BLOCK_TORCH + f"""
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
for in_place in (True, False):
    with Pipeline.load({str(int4_export)!r}, DeviceRequest(kernels="mirrorsd", draft_kv_in_place=in_place)) as pipe:
        rewritten = pipe.placements["draft"].kv_in_place if in_place else pipe.placements["draft"].fused_attention
        assert rewritten == 2, pipe.placements["draft"]
        ar = pipe.generate([1, 17, 42], GenerationConfig(mode="ar", max_new_tokens=8)).tokens
        assert pipe.generate([1, 17, 42], GenerationConfig(mode="sd", max_new_tokens=8)).tokens == ar
assert not any(m.split('.')[0] in ('onnx', 'torch') for m in sys.modules)
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
