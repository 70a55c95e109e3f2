"""Building the kernel library: on demand into a cache (concurrently safe), with CMake by hand, and the reasons it
gives when it cannot be built."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from kernel_graphs import library_or_skip, model_bytes, random_layers, run

from mirrorsd.errors import KernelsUnavailableError
from mirrorsd.devices import kernels
from mirrorsd.devices.kernels import __main__ as kernels_cli
from mirrorsd.devices.kernels import build

ort = pytest.importorskip("onnxruntime")


def outputs(library_path, a: np.ndarray) -> np.ndarray:
    layers = random_layers(np.random.default_rng(7), [200, 100], 4, bias=True)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path))
    return run(ort.InferenceSession(model_bytes(layers, kernels.DOMAIN), opts, providers=["CPUExecutionProvider"]), a)


def test_without_a_compiler_the_reason_is_given(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    monkeypatch.setattr(kernels_cli, "find_compiler", lambda: None)
    with pytest.raises(KernelsUnavailableError, match="No C.. compiler found"):
        build.library(cache=tmp_path)
    monkeypatch.setattr(kernels_cli, "library", lambda: build.library(cache=tmp_path))
    assert kernels_cli.main() == 0  # setup.sh goes on: the runtime falls back to ONNX Runtime's kernels
    assert "No C++ compiler found" in capsys.readouterr().out


def test_its_report_piped_into_head_ends_quietly():
    """`python -m mirrorsd.devices.kernels | head -1`, with the reader gone before the first line: no BrokenPipeError
    traceback, exit 0 (as every mirrorsd command, mirrorsd/cli_exit.py)."""
    library_or_skip()
    proc = subprocess.Popen([sys.executable, "-m", "mirrorsd.devices.kernels"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # every write meets EPIPE
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_failing_compiler_reports_its_error_and_leaves_nothing(monkeypatch, tmp_path):
    compiler = tmp_path / "broken-c++"
    compiler.write_text("#!/bin/sh\necho 'broken-c++ 1.0'\necho 'error: this compiler is broken' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    cache = tmp_path / "cache"
    with pytest.raises(KernelsUnavailableError, match="this compiler is broken"):
        build.library(cache=cache)
    assert not list((cache / "kernels").glob("*/libmirrorsd_kern.so"))
    assert not [p for p in (cache / "kernels").iterdir() if p.is_dir()]  # the private build folder is gone


def test_concurrent_first_builds_make_one_library(tmp_path):
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    code = f"from pathlib import Path; from mirrorsd.devices.kernels.build import library; " \
           f"print(library(cache=Path({str(tmp_path)!r})).path)"
    jobs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    paths = [job.communicate(timeout=600) for job in jobs]
    assert all(job.returncode == 0 for job in jobs), [err[-1500:] for _, err in paths]
    assert paths[0][0] == paths[1][0]
    assert len(list((tmp_path / "kernels").glob("*/libmirrorsd_kern.so"))) == 1


def test_cmake_build_gives_the_same_bits(tmp_path):
    lib = library_or_skip()
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed (the on-demand build does not need it)")
    source = build.HERE
    configure = subprocess.run(["cmake", "-S", str(source), "-B", str(tmp_path), "-DCMAKE_BUILD_TYPE=Release"],
                               capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout[-1500:] + configure.stderr[-1500:]
    made = subprocess.run(["cmake", "--build", str(tmp_path), "-j", "2"], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-1500:] + made.stderr[-1500:]
    a = np.random.default_rng(8).standard_normal((5, 200)).astype(np.float32)
    np.testing.assert_array_equal(outputs(tmp_path / "libmirrorsd_kern.so", a), outputs(lib.path, a))
