"""A damaged kernel library in the cache never gives a traceback or a wrong result: it is moved aside and rebuilt
once, or, when the rebuild fails too, ONNX Runtime's kernels run instead; one warning line says which."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from kernel_cache_damage import HOW, copying_compiler, damage, entry, links
from kernel_graphs import library_or_skip, model_bytes, random_layers, run

from mirrorsd.errors import DeviceError, KernelsUnavailableError
from mirrorsd.devices import kernels
from mirrorsd.devices.kernels import build
from mirrorsd.devices.kernels import cache as cache_entries

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def built():
    return library_or_skip().path


def outputs(library_path) -> np.ndarray:
    layers = random_layers(np.random.default_rng(7), [200, 100], 4, bias=True)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library_path))
    a = np.random.default_rng(8).standard_normal((5, 200)).astype(np.float32)
    return run(ort.InferenceSession(model_bytes(layers, kernels.DOMAIN), opts, providers=["CPUExecutionProvider"]), a)


def caught_library(cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = build.library(cache=cache)
        except KernelsUnavailableError as exc:
            found = exc
    return found, [str(w.message) for w in caught if issubclass(w.category, build.KernelCacheWarning)]


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_library_is_rebuilt_once_with_one_line(built, how, tmp_path, monkeypatch):
    compiler = copying_compiler(tmp_path / "bin", built)
    monkeypatch.setenv("CXX", str(compiler))
    cache = tmp_path / "cache"
    folder = damage(cache, compiler, how, built)
    found, lines = caught_library(cache)
    assert isinstance(found, kernels.KernelLibrary), found
    assert len(lines) == 1 and "damaged" in lines[0] and lines[0].endswith("rebuilt it"), lines
    assert links(compiler) == 1
    assert found.path == folder / build.LIBRARY_NAME
    np.testing.assert_array_equal(outputs(found.path), outputs(built))
    moved = list(folder.parent.parent.glob(".*.damaged-*")) + list(folder.parent.glob(".*.damaged-*"))
    assert len(moved) == 1, "the damaged entry is kept aside, not deleted"
    again, lines = caught_library(cache)  # the next process trusts the rebuilt entry: no build, no line
    build._RESOLVED.clear()
    again, lines = caught_library(cache)
    assert again == found and lines == [] and links(compiler) == 1


@pytest.mark.parametrize("how", ["empty", "garbage", "entry-is-a-file"])
def test_when_the_rebuild_fails_too_onnx_runtimes_kernels_run_and_say_so(built, how, tmp_path, monkeypatch):
    compiler = copying_compiler(tmp_path / "bin", built, works=False)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    damage(tmp_path / "cache", compiler, how, built)
    found, lines = caught_library(None)
    assert isinstance(found, KernelsUnavailableError) and "stand-in compiler refuses" in str(found)
    assert len(lines) == 1 and "ONNX Runtime's kernels run instead" in lines[0], lines
    tried = links(compiler)
    from mirrorsd.devices.kernel_choice import resolve_kernels

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # settled once per process: no second line, no second build
        assert resolve_kernels("auto")[0] == "ort"
        assert kernels.build_id() is None
        with pytest.raises(DeviceError, match="mirrorsd's kernels cannot run here"):
            resolve_kernels("mirrorsd")  # asked for by name: an error with the reason, not a fallback
    assert links(compiler) == tried


def test_an_entry_another_process_repaired_meanwhile_is_kept(built, tmp_path, monkeypatch):
    compiler = copying_compiler(tmp_path / "bin", built)
    cache = tmp_path / "cache"
    folder = damage(cache, compiler, "empty", built)
    seen = cache_entries.identity(folder)  # this process found it damaged; then, before it held the lock...
    cache_entries.move_aside(folder)  # ...another one moved it aside and published a sound build
    build._build_locked(str(compiler), folder, None)
    assert links(compiler) == 1 and cache_entries.entry_problem(folder, build.LIBRARY_NAME) is None
    build._build_locked(str(compiler), folder, "the library is empty", seen)
    assert links(compiler) == 1, "the repaired entry was rebuilt again"
    assert len(list(folder.parent.glob(".*.damaged-*"))) == 1


def test_a_cache_it_cannot_write_gives_the_reason_not_an_os_error(built, tmp_path, monkeypatch):
    compiler = copying_compiler(tmp_path / "bin", built)
    monkeypatch.setenv("CXX", str(compiler))
    cache = tmp_path / "cache"
    cache.write_text("the user's file, where MIRRORSD_CACHE points\n")  # fails for root too, unlike a read-only one
    found, lines = caught_library(cache)
    assert isinstance(found, KernelsUnavailableError) and "Cannot build the mirrorsd kernels" in str(found)
    assert lines == []  # nothing of ours was damaged: auto's ordinary fallback, its reason kept for `mirrorsd devices`
    assert cache.read_text().startswith("the user's file")


def test_a_fresh_build_leaves_a_checksum_that_matches(built):
    stamp = built.with_name(build.LIBRARY_NAME + ".sha256")
    from mirrorsd.devices.kernels.cache import digest

    assert stamp.read_text().strip() == digest(built)
    assert entry(built.parent.parent.parent, build.find_compiler()) == built.parent
