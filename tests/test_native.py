"""libmirrorsd built here (CMake, the vendored ONNX Runtime C header, the onnxruntime wheel's library) and the hosts on
top of it: its unit tests, the C++ sample (samples/cpp), the C# sample (samples/csharp/native, Mono's mcs + mono),
bad input through the C ABI, and a draft on ONNX Runtime's OpenVINO execution provider."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mirrorsd.runtime import GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 17, 42, 99, 7]
NEW = 24
NO_MONO = ("no C# compiler: Mono's mcs and mono are needed for samples/csharp/native (bash scripts/setup.sh installs "
           "mono-mcs and mono-runtime where apt-get is available)")


def token_lines(stdout: str) -> dict[str, list[int]]:
    """'ar: 1 2 3' lines of the samples' output -> {"ar": [1, 2, 3]}."""
    out = {}
    for line in stdout.splitlines():
        head, _, rest = line.partition(":")
        if head in ("ar", "sd", "mirror"):
            out[head] = [int(t) for t in rest.split()]
    return out


def test_unit_tests_pass(native_build):
    done = subprocess.run([str(native_build.unit_tests)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "unit tests passed" in done.stdout, done.stdout + done.stderr


def test_hostile_driver_runs_the_catalogue_cases(native_build):
    """runtime/native/tests/hostile.c is run case by case by the reliability catalogue (tests/catalogue_native.py):
    every case it has is in the catalogue, and the other way round."""
    from catalogue_native import HOSTILE

    done = subprocess.run([str(native_build.hostile), "--list"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and sorted(done.stdout.split()) == sorted(HOSTILE)


def test_cpp_sample_equals_python_ar(native_build, exported, pipelines):
    folder = exported("llama", draft_layers=2)
    done = subprocess.run([str(native_build.cli), str(folder), "--mode", "all", "--max-new-tokens", str(NEW),
                           "--ids", *map(str, PROMPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = pipelines(folder).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    assert token_lines(done.stdout) == {"ar": expected, "sd": expected, "mirror": expected}
    assert "sd identical to ar: yes" in done.stdout and "mirror identical to ar: yes" in done.stdout
    missing = subprocess.run([str(native_build.cli), str(folder / "nowhere"), "--ids", "1"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr  # MIRRORSD_ERROR_MANIFEST


EXPECTED = {  # case -> (status, words the message must hold); 1 argument, 2 manifest, 3 graph file, 4 device
    "open: NULL folder": (1, "folder is NULL"),
    "open: NULL model": (1, "model is NULL"),
    "open: no such folder": (2, "is not a folder"),
    "open: no manifest": (2, "has no mirrorsd.json"),
    "open: garbage json": (2, "not valid JSON"),
    "open: schema version": (2, "another schema version"),
    "open: missing graph": (2, "Missing key 'draft'"),
    "open: file outside": (2, "points outside the export folder"),
    "open: absolute file": (2, "points outside the export folder"),
    "open: wrong dtype": (2, "float16"),
    "open: graph deleted": (3, "is missing"),
    "open: graph truncated": (3, "not a valid ONNX file"),
    "open: not a graph": (3, "not a valid ONNX file"),
    "open: external dotdot": (3, "from outside its folder"),
    "open: external absolute": (3, "from outside its folder"),
    "open: external nested": (3, "from outside its folder"),
    "open: external symlink": (3, "from outside its folder"),
    "open: bad struct_size": (1, "struct_size"),
    "open: negative threads": (1, "target_threads -2 is out of range"),
    "open: device bogus": (1, "Unknown device 'bogus'"),
    "open: device cuda": (4, "no CUDAExecutionProvider"),
    "open: device dml": (4, "DirectML"),
    "open: device openvino:CPU": (4, "OpenVINO runtime itself"),
    "open: device ort-openvino:NPU": (4, "static draft"),
    "open: device ort-openvino:CPU": (4, "no OpenVINO execution provider"),
    "open: kernels missing": (4, "The kernels library"),
    "open: ABI 1 struct_size": (0, ""),  # ABI 2 grew the open options and the model info at their ends
    "info: ABI 1 struct_size": (0, ""),
    "ABI 1 info": (248, "CPUExecutionProvider untouched"),  # the fields ABI 1 has, nothing past them
    "open: good": (0, ""),
    "generate: NULL model": (1, "model is NULL"),
    "generate: NULL prompt": (1, "prompt is NULL"),
    "generate: empty prompt": (1, "prompt is empty"),
    "generate: negative length": (1, "negative"),
    "generate: id -1": (1, "Prompt id -1 is out of range"),
    "generate: id = vocab": (1, "is out of range"),
    "generate: prompt over the context": (1, "the exported graphs allow"),
    "generate: NULL callback": (1, "on_token is NULL"),
    "generate: NULL config": (1, "config is NULL"),
    "generate: bad config struct_size": (1, "struct_size"),
    "generate: gamma 0": (1, "gamma must be a positive integer"),
    "generate: mode 7": (1, "Unknown mode 7"),
    "generate: budget 5": (1, "branch_budget"),
    "generate: timeout NaN": (1, "draft_timeout_s"),
    "generate: bad stats struct_size": (1, "mirrorsd_stats.struct_size"),
    "generate: good after errors": (0, ""),
    "tokens after errors": (6, ""),
    "generate: callback stops": (0, ""),
    "stopped": (3, "finish 3 new 3"),
    "closed": (0, ""),
}


def test_bad_input_returns_codes_and_text_never_crashes(native_build, exported, tmp_path):
    folder = exported("llama", draft_layers=2)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "native_bad_input.py"), str(native_build.library),
                           str(folder), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the child process died ({done.returncode}): {done.stderr[-3000:]}"
    results = {case: (status, message) for case, status, message in json.loads(done.stdout.splitlines()[-1])}
    assert set(results) == set(EXPECTED)
    for case, (status, words) in EXPECTED.items():
        got_status, message = results[case]
        assert got_status == status and words in message, (case, got_status, message)
        if status and case.startswith(("open", "generate")):
            assert "Why:" in message or "Fix:" in message, (case, message)  # what, why and what to do
        if not status and case.startswith(("open", "generate")):
            assert message == "", (case, message)  # success clears the previous error


def test_csharp_sample_equals_python_ar(native_build, exported, pipelines, tmp_path):
    if shutil.which("mcs") is None or shutil.which("mono") is None:
        pytest.skip(NO_MONO)
    source = ROOT / "samples" / "csharp" / "native"
    exe = tmp_path / "mirrorsd-sample.exe"
    built = subprocess.run(["mcs", "-langversion:7", f"-out:{exe}", str(source / "Program.cs"),
                            str(source / "MirrorSD.cs")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    folder = exported("llama", draft_layers=2)
    env = {**os.environ, "LD_LIBRARY_PATH": str(native_build.library.parent)}
    done = subprocess.run(["mono", str(exe), str(folder), "--max-new-tokens", str(NEW), "--ids", *map(str, PROMPT)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = pipelines(folder).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    assert token_lines(done.stdout) == {"ar": expected, "sd": expected, "mirror": expected}
    assert "target CPUExecutionProvider" in done.stdout
    failed = subprocess.run(["mono", str(exe), str(folder), "--ids", "1", "999999"], capture_output=True, text=True,
                            timeout=300, env=env)
    assert failed.returncode == 1 and "out of range" in failed.stderr  # MIRRORSD_ERROR_INVALID_ARGUMENT


def test_draft_on_openvino_plugin_ep_is_lossless_or_refused_clearly(native_build, exported):
    """The draft on ONNX Runtime's OpenVINO plugin EP (onnxruntime-ep-openvino, from the [openvino] extra): on an
    Intel CPU it runs, and mirror must still equal ar with the target on the CPU provider (the draft's numerics never
    change the output); elsewhere the plugin lists no device and opening fails with that reason."""
    import onnxruntime_ep_openvino

    from mirrorsd.errors import DeviceError
    from mirrorsd.runtime.native import NativeModel

    folder = exported("llama", draft_layers=2)
    try:
        model = NativeModel(folder, native_build.library, draft_device="ort-openvino:CPU",
                            openvino_ep_library=onnxruntime_ep_openvino.get_library_path())
    except DeviceError as exc:
        assert "offers no CPU device" in str(exc) and "Intel" in str(exc)
        return
    with model:
        assert model.placement["draft"] == "OpenVINOExecutionProvider:CPU"
        ar = model.generate(PROMPT, mode="ar", max_new_tokens=NEW)
        for mode in ("sd", "mirror"):
            assert model.generate(PROMPT, mode=mode, max_new_tokens=NEW).tokens == ar.tokens


@pytest.mark.parametrize("timeout", [1e300, float("inf")])
def test_a_huge_draft_timeout_means_no_limit_in_both_runtimes(native_models, exported, pipelines, timeout):
    """A draft_timeout_s past what a clock can hold (meant as "never") waits without a limit, in Python and in C,
    instead of overflowing into a negative wait that fails every mirror generation."""
    folder = exported("llama", draft_layers=2)
    expected = pipelines(folder).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    python = pipelines(folder).generate(PROMPT, GenerationConfig(mode="mirror", max_new_tokens=NEW,
                                                                 draft_timeout_s=timeout))
    native = native_models(folder).generate(PROMPT, mode="mirror", max_new_tokens=NEW, draft_timeout_s=timeout)
    assert python.tokens == expected and native.tokens == expected
