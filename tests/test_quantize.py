"""Quantized graphs: exported or re-quantized, every mode still emits exactly the (quantized) target's tokens."""
from __future__ import annotations

import hashlib

import pytest

from mirrorsd.errors import ExportOptionError
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.export.requantize import requantize
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig, Pipeline

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8]]


def modes_agree(folder) -> list[list[int]]:
    with Pipeline.load(folder) as pipe:
        outs = []
        for prompt in PROMPTS:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24)).tokens
            for mode in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=24)).tokens == ar
            outs.append(ar)
    return outs


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def test_export_with_an_int8_target_and_int4_draft(tiny_model, tmp_path):
    out = tmp_path / "q"
    export(ExportOptions(model=tiny_model("qwen2"), output=out, draft_layers=3, target_precision="int8",
                         draft_precision="int4"))
    manifest = load_manifest(out)
    assert (manifest.export_options["target_precision"], manifest.export_options["draft_precision"]) == ("int8", "int4")
    assert 0.0 <= manifest.graph("draft").validation["draft_quant_top1_agreement"] <= 1.0
    assert "target_quant_max_abs_diff" in manifest.graph("suffix").validation
    modes_agree(out)


def test_requantize_leaves_the_source_untouched(exported, tmp_path):
    source = exported("llama", draft_layers=3)
    before = digest(source)
    fp32_tokens = modes_agree(source)
    out = requantize(source, tmp_path / "d8", "fp32", "int8")
    assert digest(source) == before
    manifest = load_manifest(out)
    assert manifest.export_options["draft_precision"] == "int8"
    assert "draft_quant_max_abs_diff" in manifest.graph("draft").validation
    assert modes_agree(out) == fp32_tokens  # the target is still fp32: same tokens as before, whatever the draft
    with pytest.raises(ExportOptionError, match="already int8"):
        requantize(out, tmp_path / "again", "fp32", "int4")


def test_unknown_precision_is_refused(tiny_model, tmp_path):
    with pytest.raises(ExportOptionError, match="not a precision"):
        export(ExportOptions(model=tiny_model("llama"), output=tmp_path / "x", draft_precision="int3"))
    assert not (tmp_path / "x").exists()
