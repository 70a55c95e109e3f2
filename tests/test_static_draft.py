"""The fixed-shape draft (mirrorsd-export --static-draft): manifest entry, host-side fixed KV buffer, and the same
token ids as the dynamic draft, with OpenVINO's CPU standing in for an NPU (one static compile per batch width)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from mirrorsd import names
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.devices.probe import probe
from mirrorsd.errors import DeviceError, ExportOptionError, GenerationInputError
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.static_cache import StaticDraftModel, StaticKVCache

CAPACITY = 96
PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8], [5]]
NEW_TOKENS = 24
STAND_IN = "openvino:CPU" if probe().openvino_version is not None else "cpu"  # the NPU code path, on the CPU


@pytest.fixture(scope="module")
def static_export(tiny_model, tmp_path_factory):
    from mirrorsd.export.pipeline import ExportOptions, export

    out = tmp_path_factory.mktemp("static") / "out"
    # A 3-layer draft cut from the target accepts often, so windows, branches and rollbacks all happen.
    export(ExportOptions(model=tiny_model("llama"), output=out, draft_layers=3, static_draft=True,
                         max_context=CAPACITY))
    return out


def load(folder, draft: str, static: bool) -> Pipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Pipeline.load(folder, DeviceRequest(target="cpu", draft=draft, static_draft=static))


def test_manifest_records_the_static_draft(static_export):
    manifest = load_manifest(static_export)
    spec = manifest.graph(names.DRAFT_STATIC)
    assert spec.file == "draft_static.onnx" and spec.model == "draft"
    assert spec.static_shapes == {"past_sequence_length": CAPACITY, "sequence_length": 1,
                                  "total_sequence_length": CAPACITY + 1, "present_sequence_length": 1}
    shapes = {t.name: t.shape for t in (*spec.inputs, *spec.outputs)}
    assert shapes["attention_mask"] == ("batch_size", CAPACITY + 1)
    assert shapes["past_key_values.0.key"][2] == CAPACITY and shapes["present.0.key"][2] == 1
    assert all(d == "batch_size" or isinstance(d, int) for shape in shapes.values() for d in shape)
    assert 0 <= spec.validation["draft_static_logits"] < 1e-3
    assert manifest.export_options["static_draft"] and manifest.export_options["max_context"] == CAPACITY


def test_manifest_matches_the_schema(static_export):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[dev]')")
    from pathlib import Path

    schema = json.loads((Path(__file__).parent.parent / "docs" / "manifest.schema.json").read_text())
    data = json.loads((static_export / names.MANIFEST_FILE).read_text())
    assert not [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]


@pytest.fixture(scope="module")
def reference(static_export):
    with load(static_export, "cpu", False) as pipe:
        out = {}
        for mode in ("ar", "sd", "mirror"):
            for i, prompt in enumerate(PROMPTS):
                result = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW_TOKENS))
                out[mode, i] = (result.tokens, result.stats.accepted, result.stats.drafted)
        return out


@pytest.mark.parametrize("draft", [STAND_IN, "cpu"])
def test_static_draft_gives_the_dynamic_drafts_tokens(draft, static_export, reference):
    with load(static_export, draft, True) as pipe:
        assert isinstance(pipe.draft, StaticDraftModel) and pipe.placements["draft"].static
        assert "[static shapes]" in pipe.placements["draft"].describe()
        for mode in ("sd", "mirror"):
            for i, prompt in enumerate(PROMPTS):
                result = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW_TOKENS))
                tokens, accepted, drafted = reference[mode, i]
                assert result.tokens == tokens == reference["ar", i][0], (mode, prompt)
                if mode == "sd":  # the same proposals: the static draft computes what the dynamic one does
                    assert (result.stats.accepted, result.stats.drafted) == (accepted, drafted)
        assert result.stats.placement["draft"].endswith("[static shapes]")
        if draft.startswith("openvino"):  # fixed shapes: one compile for batch 1, one for the branch batch
            shapes = {key[0] for key in pipe.sessions["draft"].backend._variants}
            assert shapes == {(1, 1), (GenerationConfig().branch_batch, 1)}


def test_static_logits_match_dynamic_with_holes(static_export):
    """Row-level check on a branch-style batch: holes in the mask, different positions per row."""
    with load(static_export, "cpu", False) as dyn, load(static_export, STAND_IN, True) as fixed:
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, 300, 12).tolist()
        dyn.draft.reset()
        fixed.draft.reset()
        want = dyn.draft.extend(prompt)
        got = fixed.draft.extend(prompt)
        np.testing.assert_allclose(got, want, atol=1e-4)
        base_d, base_f = dyn.draft.cache.tiled(2, 3), fixed.draft.cache.tiled(2, 3)
        assert isinstance(base_f, StaticKVCache) and base_f.capacity == CAPACITY
        mask = np.ones((2, 13), np.int64)
        mask[1, 9:12] = 0  # row 1 branches off at slot 9
        ids, positions = np.array([[7], [8]]), np.array([[12], [9]])
        np.testing.assert_allclose(fixed.draft.forward(base_f, ids, mask, positions),
                                   dyn.draft.forward(base_d, ids, mask, positions), atol=1e-4)


def test_buffer_too_small_is_a_clear_error(static_export):
    with load(static_export, STAND_IN, True) as pipe:
        with pytest.raises(GenerationInputError, match="--max-context"):
            pipe.generate(list(range(1, 60)), GenerationConfig(mode="sd", max_new_tokens=40))
        result = pipe.generate(list(range(1, 60)), GenerationConfig(mode="ar", max_new_tokens=40))
        assert len(result.tokens) == 40  # target-only decoding never touches the draft's buffer
        cache = StaticKVCache(pipe.draft.session.spec.kv, 1, CAPACITY)
        with pytest.raises(GenerationInputError, match="full"):
            cache.reserve(CAPACITY + 1)


def test_static_draft_asked_of_a_folder_without_one(exported):
    with pytest.raises(DeviceError, match="--static-draft"):
        Pipeline.load(exported("llama"), DeviceRequest(target="cpu", draft="cpu", static_draft=True))


@pytest.mark.parametrize("options, match", [
    (dict(max_context=64), "without --static-draft"),
    (dict(static_draft=True, max_context=4), "out of range"),
])
def test_export_options_are_checked_before_loading(options, match, tmp_path):
    from mirrorsd.export.pipeline import ExportOptions, export

    with pytest.raises(ExportOptionError, match=match):
        export(ExportOptions(model=tmp_path / "never-loaded", output=tmp_path / "out", **options))


def test_export_cli_has_the_flags():
    from mirrorsd.export.cli import build_parser

    args = build_parser().parse_args(["--model", "m", "--output", "o", "--static-draft", "--max-context", "256"])
    assert args.static_draft and args.max_context == 256
