"""The target's KV cache written in place (devices/kernels/kv_in_place.py, src/kv_write.cpp, runtime/view_cache.py):
the rewrite on a real int4 export, the rewritten graphs' numbers against the exported graphs' bit for bit (prefill,
one-row steps, windows, a rollback), the pipeline (every mode, sampling and batches the same tokens as with the
exported graphs), the cache's growth, and a view that does not fit refused with a clear error.

What runs here: ONNX Runtime's CPU provider with mirrorsd's kernels library. The rewrite applies nowhere else (CUDA,
DirectML, OpenVINO keep the exported graphs), so nothing else is exercised. The contexts here stay short (under 128
cached tokens, one block of ONNX Runtime's reduction): beyond that, with two threads, one head's probabilities x
values product is blocked differently from the exported graph's two-head product, so the feature is off by default
(devices/kernels/README.md says what was measured)."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_graphs import library_or_skip

from mirrorsd.devices import kernels
from mirrorsd.devices.kernels.kv_in_place import OP_TYPE, kv_in_place, view_name
from mirrorsd.devices.placement import KV_IN_PLACE_MARK, DeviceRequest
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.view_cache import ViewCache

from tiny_models import build_model

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 32


@pytest.fixture(scope="module")
def lib():
    library = library_or_skip()
    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    return library


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    source = build_model(tmp_path_factory.mktemp("inplace-src"), "qwen2", layers=LAYERS, hidden=256, heads=8,
                         kv_heads=KV_HEADS)
    out = tmp_path_factory.mktemp("inplace") / "q"
    export(ExportOptions(model=source, output=out, draft_layers=2, target_precision="int4", draft_precision="int4"))
    return out


def session(model: bytes):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 2
    kernels.register(opts, replace=True, allow_slow=True)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def run(sess, feeds):
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def test_the_rewrite_replaces_every_layers_concat_and_leaves_other_graphs_alone(lib, int4_export):
    found = {}
    for graph in ("prefix", "suffix"):
        original = (int4_export / f"{graph}.onnx").read_bytes()
        rewritten, layers = kv_in_place(original)
        found[graph] = layers
        model = onnx.load_from_string(rewritten)
        inputs = {i.name for i in model.graph.input}
        assert not any(name.startswith("past_key_values") for name in inputs)
        assert not any(o.name.startswith("present") for o in model.graph.output)
        for layer in layers:
            assert (layer.kv_heads, layer.head_dim) == (KV_HEADS, HEAD_DIM)
            assert {view_name(layer.layer, kind, h) for kind in ("key", "value") for h in range(KV_HEADS)} <= inputs
        assert sum(n.op_type == OP_TYPE for n in model.graph.node) == 2 * KV_HEADS * len(layers)
        concats_of_past = [n for n in onnx.load_from_string(original).graph.node
                           if n.op_type == "Concat" and n.input[0].startswith("past_key_values")]
        assert len(concats_of_past) == 2 * len(layers)
        assert not any(n.op_type == "Concat" and n.input[0].startswith("past_key_values") for n in model.graph.node)
    assert sorted(layer.layer for graph in found.values() for layer in graph) == list(range(LAYERS))
    head = (int4_export / "exit_head.onnx").read_bytes()  # norm + LM head: no cache
    assert kv_in_place(head) == (head, [])
    assert kv_in_place(b"") == (b"", [])
    draft = (int4_export / "draft.onnx").read_bytes()  # a cache, but the draft is not the target: still rewritable
    assert len(kv_in_place(draft)[1]) == 2


def test_the_rewritten_graphs_give_the_exported_graphs_numbers_bit_for_bit(lib, int4_export):
    """Prefix then suffix, as the target runs them: a 9-token prompt, one-row steps, a 4-row window, a rollback of 3
    slots, and more steps. Every output equal bit for bit, and the host's buffers hold exactly the presents."""
    graphs = {}
    for graph in ("prefix", "suffix"):
        original = (int4_export / f"{graph}.onnx").read_bytes()
        rewritten, layers = kv_in_place(original)
        graphs[graph] = (session(original), session(rewritten), layers)
    rng = np.random.default_rng(7)
    caches = {graph: ViewCache(layers, 1, 8) for graph, (_, _, layers) in graphs.items()}  # grows past 64 slots
    past: dict[str, np.ndarray] = {}
    length = 0
    for step, (new, rollback) in enumerate([(9, 0), (1, 0), (1, 0), (4, 0), (1, 3), (2, 0), (60, 0), (1, 0)]):
        length -= rollback
        for cache in caches.values():
            cache.truncate(length)
        for name in list(past):
            past[name] = past[name][:, :, :length]
        ids = rng.integers(0, 200, (1, new)).astype(np.int64)
        common = {"attention_mask": np.ones((1, length + new), np.int64),
                  "position_ids": np.arange(length, length + new, dtype=np.int64)[None]}
        hidden = {"input_ids": ids}
        for graph in ("prefix", "suffix"):
            exported, rewritten, layers = graphs[graph]
            feeds = {**common, **hidden}
            for layer in layers:
                for name in (layer.past_key, layer.past_value):
                    feeds[name] = past.get(name, np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32))
            want = run(exported, feeds)
            got = run(rewritten, {**common, **hidden, **caches[graph].step_feeds(new)})
            caches[graph].append_presents(got, new)
            first = exported.get_outputs()[0].name
            np.testing.assert_array_equal(got[first], want[first], err_msg=f"{graph}, step {step}")
            for layer in layers:
                for kind, past_name, present in (("key", layer.past_key, layer.present_key),
                                                 ("value", layer.past_value, layer.present_value)):
                    past[past_name] = want[present]
                    views = caches[graph].step_feeds(0)  # [1, 1, length + new, D] each: what is cached now
                    for h, name in enumerate(layer.views(kind)):
                        np.testing.assert_array_equal(views[name][:, 0], want[present][:, h])
            hidden = {graphs["suffix"][0].get_inputs()[0].name: want[first]}  # the prefix's hidden state
        length += new
    assert caches["prefix"].capacity >= length > 64


def prompts():
    return [[1, 17, 42, 99, 7, 3, 3], [5, 6, 7, 5, 6, 7, 5, 6], list(range(2, 40, 3))]


def test_the_pipeline_writes_the_target_cache_in_place_and_every_mode_gives_the_same_tokens(lib, int4_export):
    runs = {}
    for in_place in (True, False):
        with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", target_kv_in_place=in_place)) as pipe:
            counts = [pipe.placements[role].kv_in_place for role in ("prefix", "suffix")]
            assert sum(counts) == (LAYERS if in_place else 0)
            assert pipe.placements["exit_head"].kv_in_place == 0 and pipe.placements["draft"].kv_in_place == 0
            assert (KV_IN_PLACE_MARK in pipe.placements["prefix"].describe()) == in_place
            assert isinstance(pipe.target.prefix_cache, ViewCache) == in_place
            for i, prompt in enumerate(prompts()):
                for mode in ("ar", "sd", "mirror", "ngram"):
                    runs[in_place, i, mode] = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=24)).tokens
                sampled = GenerationConfig(mode="sd", max_new_tokens=16, do_sample=True, temperature=0.9, seed=i)
                runs[in_place, i, "sampled"] = pipe.generate(prompt, sampled).tokens
            runs[in_place, "batch"] = pipe.generate_batch(prompts(), max_new_tokens=12)
    for i in range(len(prompts())):
        ar = runs[False, i, "ar"]
        for mode in ("ar", "sd", "mirror", "ngram"):
            assert runs[True, i, mode] == ar, (i, mode)
        assert runs[True, i, "sampled"] == runs[False, i, "sampled"]
    assert runs[True, "batch"] == runs[False, "batch"]
    assert [row[:12] for row in runs[True, "batch"]] == [runs[False, i, "ar"][:12] for i in range(len(prompts()))]


def test_a_view_that_does_not_fit_is_refused_with_the_node_and_the_fix(lib, int4_export):
    rewritten, layers = kv_in_place((int4_export / "prefix.onnx").read_bytes())
    sess = session(rewritten)
    feeds = {"input_ids": np.array([[3, 4]], np.int64), "attention_mask": np.ones((1, 2), np.int64),
             "position_ids": np.array([[0, 1]], np.int64)}
    for layer in layers:
        for kind in ("key", "value"):
            for name in layer.views(kind):
                feeds[name] = np.zeros((1, 1, 1, HEAD_DIM), np.float32)  # one slot where the call adds two
    with pytest.raises(Exception, match=r"KVWrite node .*do not fit.*Fix: feed the view"):
        run(sess, feeds)
