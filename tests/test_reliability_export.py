"""Exporter reliability: damaged weights, pickle, Ctrl-C, a full disk and --force never leave anything half done.

Complements test_export_errors.py (CLI refusals of bad arguments): here the faults strike in the middle of a run.
Every case checks the same outcome: a MirrorSDError with what/why/fix (or exit code 130 for Ctrl-C), no output
folder (or the old one, untouched), and no ``.NAME.partial-*`` / ``.NAME.replaced-*`` / ``.trace-*`` left over.
"""
from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mirrorsd.errors import ModelSourceError, MirrorSDError, OutputFolderError
from mirrorsd import output_folder
from mirrorsd.export import assembly, onnx_writer
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.names import MANIFEST_FILE

from child_process import python_command
from tiny_models import build_model


def leftovers(out: Path) -> list[str]:
    """Scratch, replaced or trace folders beside (or inside) ``out`` that a finished export must not leave."""
    if not out.parent.exists():
        return []
    found = [p.name for p in out.parent.iterdir() if p.name.startswith((f".{out.name}.", ".trace-"))]
    if out.is_dir():
        found += [p.name for p in out.iterdir() if p.name.startswith(".")]
    return found


def assert_clear(exc: MirrorSDError) -> None:
    assert exc.what and exc.why and exc.fix, str(exc)
    assert "Fix:" in str(exc)


def assert_refused(options: ExportOptions, error=MirrorSDError, *phrases: str) -> MirrorSDError:
    with pytest.raises(error) as info:
        export(options)
    assert_clear(info.value)
    for phrase in phrases:
        assert phrase in str(info.value)
    assert not Path(options.output).exists()
    assert not leftovers(Path(options.output))
    return info.value


@pytest.fixture()
def out(tmp_path):
    return tmp_path / "exports" / "model"


@pytest.fixture()
def model_copy(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), folder)
    return folder


# ---- damaged weights -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [8, 100, 0.5, -1])
def test_truncated_safetensors(model_copy, out, keep):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    weights.write_bytes(data[:size])
    assert_refused(ExportOptions(model=model_copy, output=out), ModelSourceError, "complete")


@pytest.fixture(scope="module")
def smollm2_gguf():
    from mirrorsd.weights import fetch_gguf

    return fetch_gguf("smollm2-135m", progress=False)  # verified cache hit, or a one-time pinned download


@pytest.mark.slow  # reads a real 98 MB GGUF (about 5 s per case)
@pytest.mark.parametrize("keep", [64, 4096, 0.5])
def test_truncated_gguf(smollm2_gguf, tmp_path, out, keep):
    size = smollm2_gguf.stat().st_size
    size = int(size * keep) if isinstance(keep, float) else keep
    damaged = tmp_path / "SmolLM2.gguf"
    with open(smollm2_gguf, "rb") as src, open(damaged, "wb") as dst:
        dst.write(src.read(size))
    assert_refused(ExportOptions(model=damaged, output=out, draft_layers=2), ModelSourceError, "complete")


# ---- no pickle -----------------------------------------------------------------------------------------------
class _Booby:
    """Unpickling this creates ``marker``: proof that something ran the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickle_beside_safetensors_is_never_loaded(model_copy, out, tmp_path, monkeypatch):
    import torch

    marker = tmp_path / "pickle-ran"
    (model_copy / "pytorch_model.bin").write_bytes(pickle.dumps(_Booby(marker)))
    (model_copy / "training_args.bin").write_bytes(pickle.dumps(_Booby(marker)))

    def refuse(*args, **kwargs):
        raise AssertionError(f"torch.load was called: {args[:1]}")

    monkeypatch.setattr(torch, "load", refuse)
    export(ExportOptions(model=model_copy, output=out))
    assert not marker.exists()
    assert (out / MANIFEST_FILE).is_file()
    assert not list(out.rglob("*.bin"))


# ---- Ctrl-C on the real CLI ------------------------------------------------------------------------------------
def test_sigint_mid_export_leaves_nothing(tiny_model, out):
    model = tiny_model("llama", layers=8)  # deep enough that tracing lasts a few seconds
    # the child gets SIGINT's default disposition, as from an interactive shell (tests/child_process.py)
    proc = subprocess.Popen(python_command("-m", "mirrorsd.export.cli", "--model", str(model), "--output", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "writing suffix" in line:  # prefix.onnx and exit_head.onnx are in the scratch folder by now
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any("writing suffix" in s for s in seen), "".join(seen)
    assert code == 130, "".join(seen) + rest
    assert "interrupted: nothing was written" in rest
    assert "Traceback" not in rest
    assert not out.exists()
    assert not leftovers(out)


# ---- a write failure in the middle ------------------------------------------------------------------------------
def fail_on_graph(monkeypatch, n: int, error: BaseException) -> list[Path]:
    """Make the ``n``-th graph write raise ``error`` (after the earlier graphs were written for real)."""
    written: list[Path] = []
    real = assembly.write_stack

    def write(stack, pieces, source, path, *args, **kwargs):
        if len(written) + 1 == n:
            raise error
        written.append(path)
        return real(stack, pieces, source, path, *args, **kwargs)

    monkeypatch.setattr(assembly, "write_stack", write)
    return written


def test_disk_full_mid_export_leaves_nothing(tiny_model, out, monkeypatch):
    written = fail_on_graph(monkeypatch, 3, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    exc = assert_refused(ExportOptions(model=tiny_model("llama"), output=out), OutputFolderError)
    assert len(written) == 2  # two graphs really were on disk when the third failed
    assert os.strerror(errno.ENOSPC) in exc.why and isinstance(exc.__cause__, OSError)


@pytest.fixture()
def old_export(tiny_model, out):
    """A finished export at ``out`` with a file of the user's inside it."""
    export(ExportOptions(model=tiny_model("llama"), output=out, exit_layer=1))
    (out / "notes.txt").write_text("mine")
    return (out / MANIFEST_FILE).read_bytes()


def assert_old_intact(out: Path, manifest: bytes) -> None:
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / MANIFEST_FILE).read_bytes() == manifest
    assert not leftovers(out)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
def test_failed_force_export_keeps_the_old_folder(old_export, tiny_model, out, monkeypatch, error):
    fail_on_graph(monkeypatch, 3, error)
    with pytest.raises((MirrorSDError, KeyboardInterrupt)):
        export(ExportOptions(model=tiny_model("llama"), output=out, exit_layer=2, force=True))
    assert_old_intact(out, old_export)


def test_failed_swap_restores_the_old_folder(old_export, tiny_model, out, monkeypatch):
    real, calls = os.replace, []

    def replace(src, dst):
        if Path(dst).parent == out.parent:  # the renames of the publishing step, nothing else
            calls.append((Path(src).name, Path(dst).name))
            if len(calls) == 2:  # old -> .replaced worked; scratch -> output fails
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(src, dst)

    monkeypatch.setattr(output_folder.os, "replace", replace)
    with pytest.raises(OutputFolderError):
        export(ExportOptions(model=tiny_model("llama"), output=out, exit_layer=2, force=True))
    assert calls[1][1] == out.name and calls[2] == (calls[0][1], out.name)  # and the old folder moved back
    assert_old_intact(out, old_export)


def test_force_replaces_only_after_success(old_export, tiny_model, out):
    export(ExportOptions(model=tiny_model("llama"), output=out, exit_layer=2, force=True))
    assert not (out / "notes.txt").exists()
    assert b'"exit_layer": 2' in (out / MANIFEST_FILE).read_bytes()
    assert not leftovers(out)


def test_published_folder_has_normal_permissions(tiny_model, out):
    export(ExportOptions(model=tiny_model("llama"), output=out))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's private 0700


def test_draft_folder_with_truncated_weights(tiny_model, tmp_path, out):
    draft = build_model(tmp_path / "draft", "llama", layers=2, seed=3)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    assert_refused(ExportOptions(model=tiny_model("llama"), draft=draft, output=out), ModelSourceError, str(draft))


def test_large_graph_layout_is_readable_and_loads(tiny_model, out, monkeypatch, pipelines):
    """Graphs over 2 GB keep their weights in NAME.onnx.data (forced here with a zero limit): those files are as
    readable as the rest, and the folder decodes exactly as the single-file export does."""
    from mirrorsd.runtime import GenerationConfig

    inline = out.with_name("inline")
    export(ExportOptions(model=tiny_model("llama"), output=inline))
    monkeypatch.setattr(onnx_writer, "PROTOBUF_LIMIT", 0)
    export(ExportOptions(model=tiny_model("llama"), output=out))
    data = sorted(p.name for p in out.glob("*.onnx.data"))
    assert data == ["draft.onnx.data", "exit_head.onnx.data", "prefix.onnx.data", "suffix.onnx.data"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes  # onnx writes .data files 0600 unless told otherwise
    config = GenerationConfig(mode="mirror", max_new_tokens=24)
    prompt = [1, 17, 42, 99, 7]
    assert pipelines(out).generate(prompt, config).tokens == pipelines(inline).generate(prompt, config).tokens



# What numpy's lazy `import numpy.random` did in CI: the handler's raise landed in a Cython module's import and never
# reached mirrorsd. Run in a child process: a real SIGTERM, away from the threads earlier tests left in this one.
SWALLOWED_SIGTERM = """
import os, signal, sys
from pathlib import Path
from mirrorsd.cli_exit import run_command
from mirrorsd.output_folder import staged

def swallowed():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except BaseException:
        pass

def body():
    if len(sys.argv) > 1:
        with staged(Path(sys.argv[1])) as scratch:
            (scratch / "file").write_text("work")
            swallowed()
    else:
        swallowed()
    return 0

sys.exit(run_command(body))
"""


@pytest.mark.parametrize("publishes", [False, True], ids=["plain", "staged-folder"])
def test_swallowed_sigterm_still_ends_the_command_as_terminated(tmp_path, publishes):
    from mirrorsd.cli_exit import SIGTERM_EXIT

    target = tmp_path / "out"
    args = [str(target)] if publishes else []
    done = subprocess.run([sys.executable, "-c", SWALLOWED_SIGTERM, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == SIGTERM_EXIT, done.stderr
    assert "terminated" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing published, no scratch folder left
