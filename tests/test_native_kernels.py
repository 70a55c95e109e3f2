"""libmirrorsd with mirrorsd's MatMulNBits kernels (open option kernels_library, devices/kernels) on a wide int4
target with grouped attention and int8 activations, where ONNX Runtime's own kernel is not row-invariant on every
CPU (devices/ort_kernel_check.py): with the kernels, C ar emits the Python runtime's ar (kernels="mirrorsd", on the
graphs as exported: the C host does not write the target's cache in place) token for token, and C sd and C mirror emit C ar's tokens. A kernels path that is not a library fails with a code and
what/why/fix text."""
from __future__ import annotations

import subprocess

import pytest

from mirrorsd.devices.ort_kernel_check import ort_int8_kernel_difference
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.errors import DeviceError, GenerationInputError
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime.native import NativeModel
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.devices import kernels

from test_native import token_lines
from tiny_models import build_model

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 17, 42]]
NEW = 24
# (gamma, branches, branch_batch, budget, exit head) of the speculative modes
GRID = [(1, 1, 1, "time", True), (4, 4, 2, "time", True), (5, 6, 3, "cap", False)]
NO_KERNELS = "mirrorsd's kernels cannot run here: {}"


@pytest.fixture(scope="module")
def int4_grouped(tmp_path_factory):
    """tests/test_batch_invariance.py's wide qwen2 (hidden 256, 8 heads / 2 KV heads), int4 target and draft."""
    hf = build_model(tmp_path_factory.mktemp("wide-qwen2"), "qwen2", layers=3, hidden=256, heads=8, kv_heads=2)
    out = tmp_path_factory.mktemp("int4") / "out"
    export(ExportOptions(model=hf, output=out, draft_layers=1, target_precision="int4", draft_precision="int4"))
    assert load_manifest(out).attention == "grouped"
    return out


def test_c_with_kernels_equals_python_and_every_mode_equals_ar(native_build, int4_grouped):
    if kernels.unavailable_reason():
        pytest.skip(NO_KERNELS.format(kernels.unavailable_reason()))
    with NativeModel(int4_grouped, native_build.library, kernels="mirrorsd") as native, \
            Pipeline.load(int4_grouped, DeviceRequest(kernels="mirrorsd", target_kv_in_place=False)) as pipe:
        assert native.kernels == {"target": "mirrorsd", "draft": "mirrorsd"} and native.inexact_windows() == ""
        assert pipe.placements["suffix"].kernels == "mirrorsd"
        for prompt in PROMPTS:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
            c_ar = native.generate(prompt, mode="ar", max_new_tokens=NEW)
            assert c_ar.tokens == ar.tokens, prompt
            assert "[mirrorsd kernels]" in c_ar.stats["placement"]["target"]
            for gamma, branches, batch, budget, exit_head in GRID:
                settings = dict(max_new_tokens=NEW, gamma=gamma, branches=branches, branch_batch=batch)
                c_sd = native.generate(prompt, mode="sd", **settings)
                assert c_sd.tokens == c_ar.tokens, ("sd", gamma, prompt)
                py_sd = pipe.generate(prompt, GenerationConfig(mode="sd", **settings)).stats
                assert (c_sd.stats["steps"], c_sd.stats["accepted"]) == (py_sd.steps, py_sd.accepted)  # same draft bits
                c_mirror = native.generate(prompt, mode="mirror", branch_budget=budget, exit_head=exit_head,
                                           **settings)
                assert c_mirror.tokens == c_ar.tokens, ("mirror", gamma, budget, exit_head, prompt)


def test_ort_kernel_is_what_ort_gives(native_build, int4_grouped):
    """kernels="ort" passes no library: C ar is the Python runtime's ar on ONNX Runtime's kernel; sd is exact where
    that kernel is row-invariant (devices/ort_kernel_check.py) and refused elsewhere, as the Python runtime does
    (on the AVX2-only EPYC here C sd and C mirror left C ar's tokens on every prompt and gamma tried)."""
    with NativeModel(int4_grouped, native_build.library, kernels="ort") as native, \
            Pipeline.load(int4_grouped, DeviceRequest(kernels="ort")) as pipe:
        assert native.kernels == {"target": "ort", "draft": "ort"}
        ar = pipe.generate(PROMPTS[0], GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        c_ar = native.generate(PROMPTS[0], mode="ar", max_new_tokens=NEW).tokens
        assert c_ar == ar
        if ort_int8_kernel_difference() == 0.0:
            assert native.inexact_windows() == ""
            assert native.generate(PROMPTS[0], mode="sd", max_new_tokens=NEW).tokens == c_ar
            return
        assert "one-row path differs" in native.inexact_windows()
        for mode in ("sd", "mirror"):
            with pytest.raises(GenerationInputError, match="would not reproduce"):
                native.generate(PROMPTS[0], mode=mode, max_new_tokens=NEW)


@pytest.mark.parametrize("name,words", [("nowhere/libmirrorsd_kern.so", "is not a file"),
                                        ("mirrorsd.json", "could not be registered")])
def test_bad_kernels_library_is_an_error_with_text(native_build, int4_grouped, tmp_path, name, words):
    """A path that does not exist is refused before any session; a file that is not a custom-op library is refused
    by ONNX Runtime when the first graph that runs MatMulNBits registers it. Status 4 (device), never a crash."""
    path = (tmp_path / name) if name.startswith("nowhere") else int4_grouped / name
    with pytest.raises(DeviceError) as caught:
        NativeModel(int4_grouped, native_build.library, kernels_path=path)
    message = str(caught.value)
    assert caught.value.status == 4 and words in message and "Why:" in message and "Fix:" in message, message
    assert "libmirrorsd_kern.so" in message


def test_cpp_sample_runs_the_kernels(native_build, int4_grouped):
    if kernels.unavailable_reason():
        pytest.skip(NO_KERNELS.format(kernels.unavailable_reason()))
    library = str(kernels.usable_library().path)
    done = subprocess.run([str(native_build.cli), str(int4_grouped), "--mode", "all", "--max-new-tokens", str(NEW),
                           "--kernels", library, "--ids", *map(str, PROMPTS[1])], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MatMulNBits kernels mirrorsd/mirrorsd" in done.stdout
    with NativeModel(int4_grouped, native_build.library, kernels="mirrorsd") as native:
        ar = native.generate(PROMPTS[1], mode="ar", max_new_tokens=NEW).tokens
    assert token_lines(done.stdout) == {"ar": ar, "sd": ar, "mirror": ar}
    missing = subprocess.run([str(native_build.cli), str(int4_grouped), "--kernels", "/nowhere.so", "--ids", "1"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 4 and "is not a file" in missing.stderr
