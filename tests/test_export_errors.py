"""Bad exporter input: a clear what/why/fix error, exit code != 0, and no output folder (nor scratch) left behind."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tiny_models import build_model


def run_export(*args):
    return subprocess.run([sys.executable, "-m", "mirrorsd.export.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def assert_refused(result, out, *phrases):
    assert result.returncode != 0
    assert "error: " in result.stderr and "Fix:" in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert not out.exists()
    assert not out.parent.exists() or not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.fixture()
def out(tmp_path):
    return tmp_path / "exports" / "model"


def test_missing_path(tmp_path, out):
    assert_refused(run_export("--model", tmp_path / "nope", "--output", out), out, "does not exist")


def test_folder_that_is_not_a_model(tmp_path, out):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    assert_refused(run_export("--model", folder, "--output", out), out, "not a Hugging Face model folder")


def test_file_of_the_wrong_kind(tmp_path, out):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    assert_refused(run_export("--model", bogus, "--output", out), out, "not a GGUF file")


def test_unsupported_architecture(tiny_model, tmp_path, out):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_refused(run_export("--model", folder, "--output", out), out, "gpt2", "llama, mistral, qwen2, qwen3")


def test_draft_with_another_vocabulary(tiny_model, tmp_path, out):
    other_text = ["Completely different words make a different vocabulary: zebra quartz xylophone."] * 50
    draft = build_model(tmp_path / "other_vocab", "llama", layers=2, corpus=other_text)
    result = run_export("--model", tiny_model("llama"), "--draft", draft, "--output", out)
    assert_refused(result, out, "another vocabulary")


@pytest.mark.parametrize("layer", [0, 4, 9])
def test_exit_layer_out_of_range(tiny_model, out, layer):
    result = run_export("--model", tiny_model("llama"), "--output", out, "--exit-layer", layer)
    assert_refused(result, out, f"--exit-layer {layer} is out of range", "1..3")


def test_pickle_weights_are_refused(tiny_model, tmp_path, out):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_model("llama") / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    assert_refused(run_export("--model", folder, "--output", out), out, "pickle")


def test_remote_code_is_refused_without_the_flag(tiny_model, tmp_path, out):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    assert_refused(run_export("--model", folder, "--output", out), out, "--trust-remote-code")


def test_existing_folder_is_not_clobbered(tiny_model, out):
    out.mkdir(parents=True)
    keep = out / "precious.txt"
    keep.write_text("mine")
    result = run_export("--model", tiny_model("llama"), "--output", out)
    assert result.returncode != 0 and "--force" in result.stderr
    assert keep.read_text() == "mine"


def test_help_explains_the_graphs():
    result = subprocess.run([sys.executable, "-m", "mirrorsd.export.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for word in ("prefix.onnx", "exit_head.onnx", "suffix.onnx", "draft.onnx", "--exit-layer", "--draft-layers"):
        assert word in result.stdout
