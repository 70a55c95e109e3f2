"""The target on OpenVINO's CPU plugin: fused attention, stateful KV and their rollback, and the exactness rule (a
window's rows bitwise equal to one-row decoding; sd and mirror emit exactly ar's tokens). Real OpenVINO, tiny models.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from mirrorsd.devices.backends import OpenVINOTuning, _cached_attention
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.devices.probe import probe
from mirrorsd.errors import DeviceError
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.state_cache import StateCache

pytestmark = pytest.mark.skipif(probe().openvino_version is None, reason="the openvino package is not installed")

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8], [5]]
NEW_TOKENS = 24
DEFAULT = DeviceRequest().target_openvino


def on_openvino(tuning: OpenVINOTuning = DEFAULT) -> DeviceRequest:
    return DeviceRequest(target="openvino:CPU", draft="cpu", target_threads=2, target_openvino=tuning)


@pytest.fixture(scope="module")
def int4_export(tiny_model, tmp_path_factory):
    """A qwen2-shaped tiny model (grouped KV heads, q/k/v biases) with an int4 target: the plugin then takes its
    int8-activation (dynamic quantization) kernels, as on the real int4 target."""
    out = tmp_path_factory.mktemp("ov-int4") / "out"
    export(ExportOptions(model=tiny_model("qwen2"), output=out, draft_layers=2, target_precision="int4"))
    return out


def window_vs_rows(target, prompt=PROMPTS[1], window=(5, 9, 33, 12, 8)) -> float:
    """Max |logit diff| between a verification window and the same tokens decoded one row at a time, after one
    rollback in between (the path sd takes after a rejection)."""
    target.reset(1, 64)
    target.extend(prompt)
    base = target.length
    together = target.extend(list(window))  # [5, vocab]
    target.truncate(base)
    alone = np.stack([target.extend([token])[-1] for token in window])
    return float(np.abs(together - alone).max())


def runtime_kinds(session) -> collections.Counter:
    compiled = session.backend.compiled_model()
    return collections.Counter(n.get_rt_info()["layerType"].astype(str)
                               for n in compiled.get_runtime_model().get_ordered_ops())


def test_default_target_is_stateful_with_the_plugins_attention_kernel(int4_export):
    with Pipeline.load(int4_export, on_openvino()) as pipe:
        for role in ("prefix", "suffix"):
            session = pipe.sessions[role]
            layers = len(session.spec.kv.layer_indices())
            assert session.backend.stateful and session.backend.rewrites["fused_attention"] == layers
            kinds = runtime_kinds(session)
            # one attention node per layer holds its KV (no Concat copies, no Softmax left); no KV crosses the API
            assert kinds["ScaledDotProductAttention"] == layers and kinds["Softmax"] == 0
            assert kinds["MemoryInput"] == 2 * layers
            assert _cached_attention(session.backend.compiled_model()) == layers  # each reads its cache from state
            assert isinstance(pipe.target.prefix_cache, StateCache)
        assert not pipe.sessions["exit_head"].backend.stateful  # no KV: nothing to hide


@pytest.mark.parametrize("kv_precision", ["f16", "f32", "bf16"])
def test_a_stateful_target_verifies_a_window_bitwise_as_it_decodes_rows(int4_export, kv_precision):
    """The exactness rule, bitwise: the fused stateful kernel computes each query row over its own slots, and the
    trim after a rollback restores the kept slots bit for bit (f16/bf16 round-trip through f32 exactly)."""
    tuning = dataclasses.replace(DEFAULT, kv_precision=kv_precision)
    with Pipeline.load(int4_export, on_openvino(tuning)) as pipe:
        if plugin_rows_are_bitwise():
            assert window_vs_rows(pipe.target) == 0.0
        else:  # float noise, far below a quantization step: sd/mirror stay exact up to near-ties (test below)
            assert window_vs_rows(pipe.target) < 1e-3


def plugin_rows_are_bitwise() -> bool:
    """The plugin's int8-activation kernels gave a row bitwise the same alone or in a window on the AVX-512 CPUs
    measured (AMD Zen 4, Intel Xeon); on an AVX2-only AMD EPYC one-row and window rows differed by ~2e-5."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return "avx512f" in handle.read()
    except OSError:
        return False


def test_the_window_check_sees_a_row_invariance_break(int4_export):
    """The same check on a setting known to break it (f32 activations: the plugin's one-row FullyConnected kernel
    differs from its several-row one), so that the 0.0 above is not a check that cannot fail. The runtime refuses
    no such setting (it is float noise, not a quantization step), so the target is opened by hand here."""
    from mirrorsd.devices.backends import OpenVINOSession, SessionSettings
    from mirrorsd.devices.placement import Placement, kv_pairs
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime.models import TargetModel
    from mirrorsd.runtime.session import GraphSession, Timeline, graph_path

    manifest, timeline, sessions = load_manifest(int4_export), Timeline(), {}
    tuning = OpenVINOTuning(attention="exact-softmax", dynamic_quantization_group_size=0)
    for role in ("prefix", "exit_head", "suffix"):
        spec = manifest.graph(role)
        backend = OpenVINOSession(graph_path(int4_export, spec),
                                  SessionSettings("CPU", 2, "f32", openvino=tuning, kv_pairs=kv_pairs(spec.kv)))
        sessions[role] = GraphSession(spec, backend, Placement("target", "CPU", "CPU", "openvino", False), timeline)
    target = TargetModel(sessions["prefix"], sessions["exit_head"], sessions["suffix"])
    assert 0.0 < window_vs_rows(target) < 1e-3  # float noise: visible, and far below a quantization step


def test_rollback_gives_the_state_that_never_saw_the_rejected_slots(int4_export):
    """Prompt, a 3-token window, rollback to its first token, two more: bitwise what prompt, that token, the two
    more give without the rejected two. (Not what one 10-token prefill gives: with an f16 cache the plugin's
    prefill attends to its own f32 keys, a later call to the cache's f16 ones; ar and sd both prefill the prompt.)"""
    with Pipeline.load(int4_export, on_openvino()) as pipe:
        target = pipe.target

        def after_rollback(window: list[int]):
            target.reset(1, 64)
            target.extend(PROMPTS[1])
            target.extend(window)
            target.truncate(len(PROMPTS[1]) + 1)  # keep the first of the three
            assert isinstance(target.suffix_cache, StateCache) and target.suffix.backend.state_length == 12
            logits = target.extend([77, 78])
            assert target.suffix.backend.state_length == target.length == len(PROMPTS[1]) + 3
            return logits

        rolled_back = after_rollback([5, 9, 33])
        assert np.array_equal(after_rollback([5, 120, 7]), rolled_back)  # the rejected slots leave no trace
        target.reset(1, 64)
        target.extend(PROMPTS[1])
        target.extend([5])
        if plugin_rows_are_bitwise():  # and equal to never having verified a window at all
            assert np.array_equal(target.extend([77, 78]), rolled_back)
        else:
            assert np.abs(target.extend([77, 78]) - rolled_back).max() < 1e-3
        with pytest.raises(ValueError, match="cannot truncate"):
            target.truncate(target.length + 1)


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_sd_and_mirror_emit_ar_tokens_on_the_openvino_target(int4_export, mode):
    with Pipeline.load(int4_export, on_openvino()) as pipe:
        for prompt in PROMPTS:
            want = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS)).tokens
            got = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW_TOKENS))
            assert got.tokens == want, (mode, prompt)
            assert got.stats.accepted <= got.stats.drafted


def test_the_rewritten_target_computes_the_exported_function(exported):
    """fp32: the fused, stateful target on OpenVINO decodes the same tokens as ONNX Runtime, prompt by prompt and in
    one left-padded batch (holes in the mask reach the plugin's attention kernel)."""
    folder = exported("llama")
    with Pipeline.load(folder, DeviceRequest(target="cpu", draft="cpu")) as pipe:
        want = [pipe.generate(p, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS)).tokens for p in PROMPTS]
    with Pipeline.load(folder, on_openvino()) as pipe:
        assert pipe.sessions["suffix"].backend.stateful
        got = [pipe.generate(p, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS)).tokens for p in PROMPTS]
        assert got == want
        batch = pipe.generate_batch(PROMPTS, NEW_TOKENS)
        assert [b[: len(w)] for b, w in zip(batch, want)] == want


@pytest.mark.parametrize("tuning, why", [
    (OpenVINOTuning(attention="as-exported"), "Softmax sums a row"),
    (OpenVINOTuning(attention="fused"), "several query rows"),
    (OpenVINOTuning(attention="fused", stateful=True, kv_precision="u8"), "re-quantized"),
])
def test_target_settings_that_break_exactness_are_refused(exported, tuning, why):
    with pytest.raises(DeviceError, match=why):
        Pipeline.load(exported("llama"), on_openvino(tuning))


def test_unknown_openvino_settings_fail_clearly(exported):
    for tuning, what in ((OpenVINOTuning(attention="flash", stateful=True), "attention mode"),
                         (OpenVINOTuning("fused", stateful=True, kv_precision="fp8"), "KV precision")):
        with pytest.raises(DeviceError, match=what):
            Pipeline.load(exported("llama"), on_openvino(tuning))
