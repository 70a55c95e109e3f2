"""Shared fixtures: tiny random models of every architecture and their export folders, built once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="session", autouse=True)
def profiles_stay_in_tmp(tmp_path_factory):
    """Profiles measured on the tests' exports go to a session folder, never to the user's ~/.cache/mirrorsd/profiles
    (a test that points $MIRRORSD_PROFILES elsewhere with monkeypatch still wins; subprocesses inherit it)."""
    import os

    key = "MIRRORSD_PROFILES"
    before = os.environ.get(key)
    if before is None:
        os.environ[key] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if before is None:
        os.environ.pop(key, None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(model_type, layers=4, seed=0) -> Hugging Face folder (cached per arguments)."""
    made: dict = {}

    def make(model_type: str = "llama", layers: int = 4, seed: int = 0, hidden: int = 64) -> Path:
        key = (model_type, layers, seed, hidden)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"hf-{model_type}-{layers}-{seed}")
            made[key] = build_model(folder, model_type, layers=layers, seed=seed, hidden=hidden)
        return made[key]

    return make


@pytest.fixture(scope="session")
def exported(tmp_path_factory, tiny_model):
    """exported(model_type, exit_layer=None, draft_layers=None, draft=None) -> export folder (cached)."""
    from mirrorsd.export.pipeline import ExportOptions, export

    made: dict = {}

    def make(model_type: str = "llama", exit_layer: int | None = None, draft_layers: int | None = None,
             draft: Path | None = None, layers: int = 4) -> Path:
        key = (model_type, exit_layer, draft_layers, str(draft), layers)
        if key not in made:
            out = tmp_path_factory.mktemp("export") / "out"
            export(ExportOptions(model=tiny_model(model_type, layers), output=out, exit_layer=exit_layer,
                                 draft_layers=draft_layers, draft=draft))
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def pipelines():
    """pipelines(folder) -> a loaded Pipeline, shared across tests and closed at the end."""
    from mirrorsd.runtime import Pipeline

    loaded: dict = {}

    def get(folder: Path):
        if folder not in loaded:
            loaded[folder] = Pipeline.load(folder)
        return loaded[folder]

    yield get
    for pipe in loaded.values():
        pipe.close()


@pytest.fixture(scope="session")
def native_build(tmp_path_factory):
    """libmirrorsd, its unit tests and the C++ sample (samples/cpp includes runtime/native), built once per session
    with CMake against the vendored ONNX Runtime header and the onnxruntime wheel's library."""
    import native_tools

    if why := native_tools.compiler_missing():
        pytest.skip(why)
    return native_tools.build(tmp_path_factory.mktemp("native"))


@pytest.fixture(scope="session")
def native_models(native_build):
    """native_models(folder) -> a NativeModel (libmirrorsd) on that export folder, shared and closed at the end."""
    from mirrorsd.runtime.native import NativeModel

    opened: dict = {}

    def get(folder: Path):
        if folder not in opened:
            opened[folder] = NativeModel(folder, native_build.library)
        return opened[folder]

    yield get
    for model in opened.values():
        model.close()


@pytest.fixture(autouse=True)
def no_shared_pool_in_this_process():
    """ONNX Runtime's shared pool binds the process that creates it (devices/thread_pool.py): later pipelines with
    threads of their own would fail to open. Tests that create it do so in a child process; this says which test
    broke that, instead of letting every later test fail."""
    yield
    from mirrorsd.devices.thread_pool import shared_size

    assert shared_size() is None, "this test created ONNX Runtime's shared pool in the test process: use a child"
