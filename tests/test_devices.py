"""Devices: probing, the placement policy (scenario table on made-up machines), fallbacks and explicit failures on
this machine, and the draft on every backend here keeping sd/mirror output equal to ar (greedy, f32)."""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import pytest

from mirrorsd.devices.placement import (AUTO, CHAINS, DeviceFallbackWarning, DeviceRequest, PlacementPolicy,
                                        available_devices, parse_device, plan_placement)
from mirrorsd.devices.probe import DeviceReport, PluginDevice, probe, probe_model_bytes, try_ort_provider
from mirrorsd.errors import DeviceError
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig, Pipeline

from markers import HAS_OPENVINO, needs_openvino

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8], [5]]
NEW_TOKENS = 24

BARE = DeviceReport("1.32.0", ("CPUExecutionProvider",), (), (), "not installed", (), None, (), (), "GenuineIntel")
AMD = "AuthenticAMD"


def machine(**changes) -> DeviceReport:
    return dataclasses.replace(BARE, **changes)


# ---- probing --------------------------------------------------------------------------------------------------
def test_probe_reports_this_machine():
    report = probe()
    assert "CPUExecutionProvider" in report.ort_listed and report.ort_works("CPUExecutionProvider")
    assert set(report.ort_working) <= set(report.ort_listed)
    assert report.plugin_status in ("not installed", "registered") or report.plugin_status.startswith("failed")
    assert not HAS_OPENVINO or "CPU" in report.openvino_devices
    assert report.lines() and probe() is report  # cached: placement decides from one look at the machine
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.ort_working = ("CUDAExecutionProvider",)


def test_probe_graph_runs_and_cuda_is_tried_not_trusted():
    assert try_ort_provider("CPUExecutionProvider") == (True, "")
    assert probe_model_bytes()[:2] == b"\x08\x08"  # ir_version 8: the hand-written ONNX model
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("an NVIDIA device is present: CUDA may really work here")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ORT warns that the provider is not available, when it is not even listed
        ok, why = try_ort_provider("CUDAExecutionProvider")
    assert not ok and why
    assert "CUDAExecutionProvider" not in probe().ort_working


# ---- device strings -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, backend, device", [
    ("cpu", "onnxruntime", "cpu"), ("ORT-CPU", "onnxruntime", "cpu"), ("cuda", "onnxruntime", "cuda"),
    ("dml", "onnxruntime", "dml"), ("openvino:CPU", "openvino", "CPU"), ("openvino:npu", "openvino", "NPU"),
    ("ov:GPU.1", "openvino", "GPU.1"), ("ort-openvino:NPU", "ort-openvino", "NPU"),
])
def test_parse_device(text, backend, device):
    choice = parse_device(text)
    assert (choice.backend, choice.device) == (backend, device)
    assert choice.fixed_shapes == (device == "NPU")


@pytest.mark.parametrize("text", ["gpu", "openvino", "openvino:TPU", "cuda:0", "onnxruntime:cpu", ""])
def test_unknown_device_string_fails_with_the_syntax(text):
    with pytest.raises(DeviceError, match="openvino:CPU\\|GPU\\|NPU"):
        parse_device(text)


# ---- the policy on made-up machines ---------------------------------------------------------------------------
NPU_PLUGIN = (PluginDevice("OpenVINOExecutionProvider", "NPU", "Intel"),)
BROKEN_CUDA = machine(ort_listed=("CUDAExecutionProvider", "CPUExecutionProvider"),
                      ort_failures=(("CUDAExecutionProvider", "no driver"),))
# (machine, model, static draft in the folder, expected device, fell back, static). "Fell back" (a warning) only
# when a device that is here could not take the graph; skipping absent devices, or OpenVINO's CPU plugin (which
# auto does not pick, devices/placement.auto_skips), is the expected case.
SCENARIOS = [
    (BARE, "target", False, "cpu", False, False),
    (BARE, "draft", False, "cpu", False, False),
    (BROKEN_CUDA, "target", False, "cpu", True, False),
    (machine(ort_working=("CUDAExecutionProvider",)), "target", False, "cuda", False, False),
    (machine(ort_working=("DmlExecutionProvider",)), "target", False, "dml", False, False),
    (machine(openvino_version="x", openvino_devices=("CPU", "GPU.0")), "target", False, "openvino:GPU", False, False),
    (machine(openvino_version="x", openvino_devices=("CPU", "NPU")), "target", True, "cpu", False, False),
    (machine(openvino_version="x", openvino_devices=("CPU", "NPU")), "draft", True, "openvino:NPU", False, True),
    # an NPU here, but the export has no static draft: a surprise worth a warning
    (machine(openvino_version="x", openvino_devices=("CPU", "NPU")), "draft", False, "cpu", True, False),
    (machine(plugin_status="registered", plugin_devices=NPU_PLUGIN), "draft", True, "ort-openvino:NPU", False, True),
    (machine(openvino_version="x", openvino_devices=("CPU",)), "draft", True, "cpu", False, False),
    (machine(openvino_version="x", openvino_devices=("CPU",), cpu_vendor=AMD), "draft", True, "cpu", False, False),
    (machine(openvino_version="x", openvino_devices=("CPU", "NPU"), cpu_vendor=AMD), "draft", True, "openvino:NPU",
     False, True),
]


@pytest.mark.parametrize("report, model, static_available, label, fell_back, static", SCENARIOS)
def test_auto_chains(report, model, static_available, label, fell_back, static):
    decision = PlacementPolicy(report).decide(model, AUTO, static_available)
    assert (decision.choice.label, decision.fell_back, decision.static) == (label, fell_back, static)
    assert bool(decision.reason) == (label != CHAINS[model][0])  # every skipped entry says why


def test_auto_never_picks_openvino_cpu_but_an_explicit_request_gets_it():
    report = machine(openvino_version="x", openvino_devices=("CPU",))
    decision = PlacementPolicy(report).decide("draft", AUTO)
    assert decision.choice.label == "cpu" and "OpenVINO's CPU plugin" in decision.reason
    assert PlacementPolicy(report).decide("draft", "openvino:CPU").choice.label == "openvino:CPU"


def test_npu_without_static_draft_says_how_to_get_one():
    report = machine(openvino_version="x", openvino_devices=("CPU", "NPU"))
    decision = PlacementPolicy(report).decide("draft", AUTO, static_available=False)
    assert "--static-draft" in decision.reason
    with pytest.raises(DeviceError, match="--static-draft"):
        PlacementPolicy(report).decide("draft", "openvino:NPU", static_available=False)
    with pytest.raises(DeviceError, match="dynamic"):
        PlacementPolicy(report).decide("target", "openvino:NPU")


@pytest.mark.parametrize("model, device", [("draft", "openvino:NPU"), ("target", "cuda"), ("target", "dml"),
                                           ("draft", "ort-openvino:NPU"), ("target", "openvino:GPU")])
def test_explicit_device_missing_here_fails_listing_what_exists(model, device):
    if device in available_devices(probe()):
        pytest.skip(f"{device} exists on this machine")
    with pytest.raises(DeviceError) as err:
        PlacementPolicy().decide(model, device, static_available=True)
    message = str(err.value)
    assert device in message and "cpu" in message
    assert all(d in message for d in available_devices(probe()))


# ---- pipelines on this machine --------------------------------------------------------------------------------
def test_explicit_cuda_or_npu_fails_at_load(exported):
    folder = exported("llama")
    for request in (DeviceRequest(target="cuda"), DeviceRequest(draft="openvino:NPU")):
        if request.target in available_devices(probe()) or request.draft in available_devices(probe()):
            continue
        with pytest.raises(DeviceError, match="this machine has: cpu"):
            Pipeline.load(folder, request)


def test_auto_on_a_machine_without_accelerators_is_quiet(exported, caplog):
    """Using the only device there is: no warning, one INFO line, and statistics that do not say "fell back"."""
    report = probe()
    if report.openvino_has("NPU") or report.plugin_has("NPU") or report.ort_working or report.openvino_has("GPU"):
        pytest.skip("this machine has an accelerator: auto does not fall back to the CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with caplog.at_level(logging.INFO, logger="mirrorsd.devices"):
            pipe = Pipeline.load(exported("llama"))
    assert [r.levelno for r in caplog.records if r.name == "mirrorsd.devices"] == [logging.INFO]
    with pipe:
        placement = pipe.placements["draft"]
        assert not placement.fell_back and placement.requested == AUTO and placement.effective == "CPUExecutionProvider"
        stats = pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=8)).stats
    assert "fell back" not in stats.placement["draft"]
    assert set(stats.placement) == {"prefix", "exit_head", "suffix", "draft"}


def test_a_device_that_is_here_and_fails_still_warns(exported):
    manifest = load_manifest(exported("llama"))
    with pytest.warns(DeviceFallbackWarning, match="CUDAExecutionProvider"):
        plan = plan_placement(manifest, DeviceRequest(), PlacementPolicy(BROKEN_CUDA))
    assert plan.target.fell_back and plan.target.choice.label == "cpu"


@pytest.fixture(scope="module")
def reference_tokens(exported):
    with Pipeline.load(exported("llama"), DeviceRequest(target="cpu", draft="cpu")) as pipe:
        return [pipe.generate(p, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS)).tokens for p in PROMPTS]


@pytest.mark.parametrize("draft_device", ["cpu", pytest.param("openvino:CPU", marks=needs_openvino)])
def test_draft_backends_keep_sd_and_mirror_equal_to_ar(draft_device, exported, reference_tokens):
    with Pipeline.load(exported("llama"), DeviceRequest(target="cpu", draft=draft_device)) as pipe:
        placement = pipe.placements["draft"]
        assert not placement.fell_back and placement.requested == draft_device
        for mode in ("sd", "mirror"):
            for prompt, want in zip(PROMPTS, reference_tokens):
                result = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW_TOKENS))
                assert result.tokens == want, (draft_device, mode, prompt)
                assert result.stats.accepted <= result.stats.drafted


@needs_openvino
def test_openvino_session_computes_in_f32_on_the_threads_given(exported):
    with Pipeline.load(exported("llama"), DeviceRequest(target="cpu", draft="openvino:CPU", draft_threads=1)) as pipe:
        compiled = next(iter(pipe.sessions["draft"].backend._variants.values()))[0]
        assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
        assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert pipe.sessions["draft"].backend.effective == "CPU"


def test_plugin_ep_draft_keeps_parity(exported, reference_tokens):
    report = probe()
    if report.plugin_status != "registered":
        pytest.skip(f"the OpenVINO plugin EP (onnxruntime-ep-openvino) is {report.plugin_status}")
    kinds = sorted({d.kind for d in report.plugin_devices})
    if not kinds:
        pytest.skip("the OpenVINO plugin EP lists no device here: it only sees Intel CPUs, GPUs and NPUs")
    device = f"ort-openvino:{'CPU' if 'CPU' in kinds else kinds[0]}"
    with Pipeline.load(exported("llama"), DeviceRequest(target="cpu", draft=device)) as pipe:
        assert "OpenVINO" in pipe.placements["draft"].effective
        for prompt, want in zip(PROMPTS, reference_tokens):
            assert pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW_TOKENS)).tokens == want


def test_devices_command_prints_machine_and_plan(exported, capsys):
    from mirrorsd.apps.cli import main

    assert main(["devices", "--model", str(exported("llama"))]) == 0
    out = capsys.readouterr().out
    assert "CPUExecutionProvider" in out and "auto chains:" in out
    assert "target (asked: auto) ->" in out and "draft (asked: auto) ->" in out
    assert "prefix.onnx" in out and "draft.onnx" in out
    assert main(["devices", "--draft-device", "openvino:NPU", "--model", str(exported("llama"))]) == 2 \
        or probe().openvino_has("NPU")
