"""The target's KV cache written in place (devices/kernels/kv_in_place.py, InPlaceAttention in src/attention.cpp,
runtime/view_cache.py): the rewrite on a real int4 export, the rewritten graphs' numbers against the exported graphs'
(within float rounding: the fused node rounds its own way), each row's bits independent of the window it is in and
of the thread count at contexts past ONNX Runtime's reduction blocks (what keeps every decoder equal to one-row
decoding), the pipeline (every mode the same tokens as ar with it on), the cache's growth, and a view that does not
fit refused with a clear error.

What runs here: ONNX Runtime's CPU provider with mirrorsd's kernels library, on this CPU's attention path (AVX2 where
the CPU has it; the plain C++ path is checked by tests/test_fused_attention.py's odd head size). The rewrite applies
nowhere else (CUDA, DirectML, OpenVINO keep the exported graphs), so nothing else is exercised."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_exports import kernels_or_skip, tiny_qwen_export

from mirrorsd.devices import kernels
from mirrorsd.devices.kernels.kv_in_place import OP_TYPE, kv_in_place, view_name
from mirrorsd.devices.placement import KV_IN_PLACE_MARK, DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.view_cache import ViewCache

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 32
DRAFT_LAYERS = 2


@pytest.fixture(scope="module")
def lib():
    return kernels_or_skip()


def tiny_export(tmp_path_factory, precision: str):
    return tiny_qwen_export(tmp_path_factory, "inplace", precision, LAYERS, KV_HEADS, DRAFT_LAYERS)


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    return tiny_export(tmp_path_factory, "int4")


@pytest.fixture(scope="module")
def f32_export(tmp_path_factory):
    """The same model with float weights: no activation quantization that a rounding difference could flip."""
    return tiny_export(tmp_path_factory, "fp32")


def session(model: bytes, threads: int = 2, replace: bool = True):
    """replace: mirrorsd's kernels run the int4 graphs' MatMulNBits (as the pipeline does); float graphs have none."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    kernels.register(opts, replace=replace, allow_slow=True)
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
        assert sum(n.op_type == OP_TYPE for n in model.graph.node) == len(layers)
        assert not any(n.op_type == "Softmax" for n in model.graph.node)  # the eager attention's nodes are gone
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


def target_graphs(folder, threads: int = 2, replace: bool = True):
    graphs = {}
    for graph in ("prefix", "suffix"):
        original = (folder / f"{graph}.onnx").read_bytes()
        rewritten, layers = kv_in_place(original)
        graphs[graph] = (session(original, threads, replace), session(rewritten, threads, replace), layers)
    return graphs


def call(graphs, caches, ids, length):
    """Prefix then suffix through the rewritten graphs on the views: the suffix's first output (the logits)."""
    new = ids.shape[1]
    common = {"attention_mask": np.ones((1, length + new), np.int64),
              "position_ids": np.arange(length, length + new, dtype=np.int64)[None]}
    feeds = {"input_ids": ids}
    for graph in ("prefix", "suffix"):
        _, rewritten, _ = graphs[graph]
        got = run(rewritten, {**common, **feeds, **caches[graph].step_feeds(new)})
        caches[graph].append_presents(got, new)
        first = rewritten.get_outputs()[0].name
        feeds = {graphs["suffix"][1].get_inputs()[0].name: got[first]}
    return got[first]


def test_the_rewritten_graphs_give_the_exported_graphs_numbers(lib, f32_export):
    """Prefix then suffix, as the target runs them: a 9-token prompt, one-row steps, a 4-row window, a rollback of 3
    slots, and more steps. Every output within float rounding of the exported graph's, and the host's buffers hold
    the presents (the first layer's keys and values bit for bit: the same rotary, copied). Float weights: with int4
    weights the kernels quantize activations to 8 bits, where a rounding difference can move a value one step."""
    graphs = target_graphs(f32_export, replace=False)
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
            scale = float(np.abs(want[first]).max())
            np.testing.assert_allclose(got[first], want[first], rtol=0, atol=1e-4 * scale, err_msg=f"{graph} {step}")
            for layer in layers:
                for kind, past_name, present in (("key", layer.past_key, layer.present_key),
                                                 ("value", layer.past_value, layer.present_value)):
                    past[past_name] = want[present]
                    views = caches[graph].step_feeds(0)  # [1, 1, length + new, D] each: what is cached now
                    for h, name in enumerate(layer.views(kind)):
                        if graph == "prefix" and layer.layer == 0 and step == 0:
                            np.testing.assert_array_equal(views[name][:, 0], want[present][:, h])
                        np.testing.assert_allclose(views[name][:, 0], want[present][:, h], rtol=0,
                                                   atol=1e-4 * float(np.abs(want[present]).max()))
            hidden = {graphs["suffix"][0].get_inputs()[0].name: want[first]}  # the prefix's hidden state
        length += new
    assert caches["prefix"].capacity >= length > 64


def test_a_rows_bits_do_not_depend_on_its_window_or_the_threads(lib, int4_export):
    """After 300 cached tokens (past ONNX Runtime's 128-slot reduction blocks), 100 tokens decoded one row at a time,
    as windows of 40 and 60 rows (4 x 40 = 160 query rows per KV head, more than the head size: where ONNX Runtime's
    MatMul splits rows instead of columns) and as one 100-row window (400 query rows per KV head: the op's longer
    tasks, as a prompt chunk gets), on 2 threads and on 1: the logits bit for bit."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 200, (1, 300)).astype(np.int64)
    tail = rng.integers(0, 200, (1, 100)).astype(np.int64)
    windows = {"rows": [1] * 100, "40 + 60": [40, 60], "100": [100]}
    results = {}
    for threads in (2, 1):
        graphs = target_graphs(int4_export, threads)
        for how, widths in windows.items():
            caches = {graph: ViewCache(layers, 1, 64) for graph, (_, _, layers) in graphs.items()}
            call(graphs, caches, prompt[:, :256], 0)  # the prompt in two chunks
            call(graphs, caches, prompt[:, 256:], 256)
            parts, start = [], 0
            for width in widths:
                parts.append(call(graphs, caches, tail[:, start:start + width], 300 + start))
                start += width
            results[threads, how] = np.concatenate(parts, axis=1)
    want = results[1, "rows"]
    assert want.shape[1] == 100
    for key, got in results.items():
        np.testing.assert_array_equal(got, want, err_msg=str(key))


def prompts():
    return [[1, 17, 42, 99, 7, 3, 3], [5, 6, 7, 5, 6, 7, 5, 6], list(range(2, 40, 3))]


def test_the_pipeline_writes_the_target_cache_in_place_and_every_mode_gives_ars_tokens(lib, int4_export):
    runs = {}
    for in_place in (True, False):
        with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", target_kv_in_place=in_place,
                                                      draft_kv_in_place=in_place)) as pipe:
            counts = [pipe.placements[role].kv_in_place for role in ("prefix", "suffix")]
            assert sum(counts) == (LAYERS if in_place else 0)
            assert pipe.placements["exit_head"].kv_in_place == 0
            assert pipe.placements["draft"].kv_in_place == (DRAFT_LAYERS if in_place else 0)
            assert pipe.placements["draft"].fused_attention == (0 if in_place else DRAFT_LAYERS)
            assert (KV_IN_PLACE_MARK in pipe.placements["prefix"].describe()) == in_place
            assert (KV_IN_PLACE_MARK in pipe.placements["draft"].describe()) == in_place
            assert isinstance(pipe.target.prefix_cache, ViewCache) == in_place
            assert isinstance(pipe.draft.cache, ViewCache) == in_place
            if not in_place:
                continue
            for i, prompt in enumerate(prompts()):
                for mode in ("ar", "sd", "mirror", "ngram"):
                    runs[i, mode] = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=24)).tokens
                sampled = GenerationConfig(mode="sd", max_new_tokens=16, do_sample=True, temperature=0.9, seed=i)
                assert pipe.generate(prompt, sampled).tokens == pipe.generate(prompt, sampled).tokens
            batch = pipe.generate_batch(prompts(), max_new_tokens=12)
    for i in range(len(prompts())):
        for mode in ("sd", "mirror", "ngram"):
            assert runs[i, mode] == runs[i, "ar"], (i, mode)
    assert [row[:12] for row in batch] == [runs[i, "ar"][:12] for i in range(len(prompts()))]


def test_a_planned_load_predicts_the_placement_that_opening_reports(lib, int4_export):
    """A plan_from_profile load (mode auto) looks its cached profile up by the placement it predicts before opening
    (runtime/planner/loading.py); with the load-time rewrites of int4 graphs the prediction must carry the marks
    opening reports ([KV in place], [fused attention]), or the profile `mirrorsd devices --profile` measured is never
    found before opening."""
    from mirrorsd.devices.placement import plan_placement
    from mirrorsd.runtime.planner.loading import predicted_placement

    for in_place, fused in ((True, True), (False, True), (False, False)):
        request = DeviceRequest(kernels="mirrorsd", target_kv_in_place=in_place, draft_kv_in_place=in_place,
                                fused_draft_attention=fused, spin_in_run=True)
        with Pipeline.load(int4_export, request) as pipe:
            plan = plan_placement(pipe.manifest, request)
            assert predicted_placement(int4_export, pipe.manifest, plan, False, True, request) == pipe.placement
            assert (KV_IN_PLACE_MARK in pipe.placement["draft"]) == in_place
            assert ("[fused attention]" in pipe.placement["draft"]) == (fused and not in_place)


def test_the_draft_in_place_rolls_out_the_windows_branches_and_adopted_cache_of_the_fused_draft(lib, int4_export):
    """The draft's cache written in place (InPlaceAttention, ViewCache) against the fused draft (GroupedAttention,
    KVCache, presents copied back), on one prompt each: the same fresh window and top ids, the same branch rows
    (three rows on a tiled cache, the later window slots masked as holes, one row a branch past the window), the
    same KV after a branch is adopted, and the same next window. Both nodes share one attention routine, so the
    logits agree within float rounding (bit for bit on the runs this was written on)."""
    from mirrorsd.runtime.rollout import adopt, branches, fresh
    from mirrorsd.runtime.sampling import GREEDY
    from mirrorsd.runtime.verify import Branch

    g, got = 4, {}
    for in_place in (True, False):
        with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", draft_kv_in_place=in_place)) as pipe:
            draft = pipe.draft
            assert isinstance(draft.cache, ViewCache) == in_place
            for i, committed in enumerate(prompts()):
                draft.reset(capacity=8)  # grows while it goes
                window = fresh(draft, committed, g, top_k=3)
                draft.extend([int(window.tokens[-1])])  # main cache: committed + window (what Mirror-SD's worker does)
                batch = [Branch(1, int(window.top_ids[0, 1]), 0.0), Branch(3, int(window.top_ids[2, 1]), 0.0),
                         Branch(g + 1, 7, 0.0)]
                rows = branches(draft, committed, window.tokens, batch, GREEDY, 3, False)
                now = committed + window.tokens[:2].tolist() + [batch[1].token]
                adopt(draft, rows[1], now)
                assert draft.cache.length == len(now) + g - 1
                kv = kv_of(draft.cache, draft.cache.length)
                after = fresh(draft, now + rows[1].tokens.tolist(), g, top_k=3)
                got[in_place, i] = window, rows, kv, after
    for i in range(len(prompts())):
        (window, rows, kv, after), (window0, rows0, kv0, after0) = got[True, i], got[False, i]
        for a, b in [(window, window0), (after, after0), *zip(rows, rows0)]:
            assert a.tokens.tolist() == b.tokens.tolist() and a.top_ids.tolist() == b.top_ids.tolist(), i
            assert np.abs(a.top_logprobs - b.top_logprobs).max() <= 1e-5
        assert kv.shape == kv0.shape and np.abs(kv - kv0).max() <= 1e-5


def kv_of(cache, length: int, row: int = 0) -> np.ndarray:
    """``row``'s first ``length`` slots of every layer's keys and values, [layers * 2 * heads, length, D], whichever
    cache holds them (a ViewCache per layer, kind and head, a KVCache per layer and kind)."""
    if isinstance(cache, ViewCache):
        return np.stack([cache._buffers[name][row, :length] for layer in cache.layers for kind in ("key", "value")
                         for name in layer.views(kind)])
    return np.stack([kv[row, h, :length] for k, v in zip(cache.keys, cache.values) for kv in (k, v)
                     for h in range(kv.shape[1])])


def test_the_view_caches_branch_operations_match_the_buffer_caches():
    """ViewCache.tiled / adopt_slots (the draft's branch rollouts) move the slots KVCache's do, holes skipped."""
    from mirrorsd.devices.kernels.kv_in_place import InPlaceLayer
    from mirrorsd.manifest import KVSpec
    from mirrorsd.runtime.kv_cache import KVCache

    rng = np.random.default_rng(1)
    layers = [InPlaceLayer(i, 2, 4, f"past_key.{i}", f"past_value.{i}", f"present.{i}.key", f"present.{i}.value")
              for i in range(2)]
    spec = KVSpec("past_key.%d", "past_value.%d", "present.%d.key", "present.%d.value", (0, 2), 2, 4, "float32")
    views, buffers = ViewCache(layers, 1, 4), KVCache(spec, 1, 4)
    for cache in (views, buffers):
        cache.reserve(6)
        cache.length = 6
    for layer, keys, values in zip(layers, buffers.keys, buffers.values):
        for kind, data in (("key", keys), ("value", values)):
            data[0, :, :6] = rng.standard_normal((2, 6, 4))
            for h, name in enumerate(layer.views(kind)):
                views._buffers[name][0, :6] = data[0, h, :6]
    tiled_views, tiled_buffers = views.tiled(3, 5), buffers.tiled(3, 5)
    assert tiled_views.batch == 3 and tiled_views.length == 6 and tiled_views.capacity >= 11
    for row in range(3):
        assert np.array_equal(kv_of(tiled_views, 6, row), kv_of(tiled_buffers, 6, row))
    for tiled in (tiled_views, tiled_buffers):  # row 2 wrote slots 6..10 (a branch with lookahead holes)
        tiled.reserve(11)
        tiled.length = 11
    for layer, keys, values in zip(layers, tiled_buffers.keys, tiled_buffers.values):
        for kind, data in (("key", keys), ("value", values)):
            data[2, :, 6:11] = rng.standard_normal((2, 5, 4))
            for h, name in enumerate(layer.views(kind)):
                tiled_views._buffers[name][2, 6:11] = data[2, h, 6:11]
    slots = np.array([6, 8, 10])
    views.adopt_slots(tiled_views, 2, slots, 4)
    buffers.adopt_slots(tiled_buffers, 2, slots, 4)
    assert views.length == buffers.length == 7
    assert np.array_equal(kv_of(views, 7), kv_of(buffers, 7))
    assert np.array_equal(kv_of(views, 7)[:, 4:], kv_of(tiled_buffers, 11, 2)[:, slots])
    with pytest.raises(ValueError, match="cannot truncate"):
        views.adopt_slots(tiled_views, 2, slots, 8)  # past the cache's length


def test_a_view_that_does_not_fit_is_refused_with_the_node_and_the_fix(lib, int4_export):
    rewritten, layers = kv_in_place((int4_export / "prefix.onnx").read_bytes())
    sess = session(rewritten)
    feeds = {"input_ids": np.array([[3, 4]], np.int64), "attention_mask": np.ones((1, 2), np.int64),
             "position_ids": np.array([[0, 1]], np.int64)}
    for layer in layers:
        for kind in ("key", "value"):
            for name in layer.views(kind):
                feeds[name] = np.zeros((1, 1, 1, HEAD_DIM), np.float32)  # one slot where the call adds two
    with pytest.raises(Exception, match=r"InPlaceAttention node .*do not fit.*Fix: feed each view"):
        run(sess, feeds)
