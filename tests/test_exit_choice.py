"""mirrorsd-export picks its exit layer from a hit-rate sweep and a measured profile (export/exit_choice.py): the
latency model's best layer is the one the graphs are cut at, and the choice is recorded in the manifest; bad or
half-given inputs are refused before anything is written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mirrorsd.errors import ExportOptionError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "profiles"
LAYERS = 4  # the tiny llama's


def inputs(tmp_path: Path, hits: dict[int, float], layers: int = LAYERS) -> tuple[Path, Path]:
    """A sweep of ``hits`` and a profile (the RTX 4060 example with prefix times, measured at layer 2)."""
    data = json.loads((DOCS / "rtx4060-laptop-npu.json").read_text())
    split = data["splits"][0]
    data["splits"] = [{**split, "prefix_s": [v / 2 for v in split["verify_s"]], "detail": {"exit_layer": 2}}]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(data))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"layers": layers, "results": [
        {"layer": L, "trained": {"4": h}, "untrained": {"4": h / 2}} for L, h in hits.items()]}))
    return sweep, profile


def expected_layer(sweep: Path, profile: Path) -> int:
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table, read_hits

    loaded = profiles.load(profile)
    hits, _ = read_hits(json.loads(sweep.read_text()))
    return exit_layer_table(loaded.splits[0], loaded.acceptance, hits, 2)[0].layer


def test_export_cuts_the_target_at_the_latency_models_layer(tiny_model, tmp_path):
    from mirrorsd.export.options import ExportOptions
    from mirrorsd.export.pipeline import export
    from mirrorsd.manifest import load_manifest

    sweep, profile = inputs(tmp_path, {1: 0.05, 2: 0.3, 3: 0.95})
    want = expected_layer(sweep, profile)
    out = tmp_path / "export"
    export(ExportOptions(model=tiny_model("llama"), output=out, draft_layers=2, exit_hits=sweep,
                         exit_profile=profile))
    manifest = load_manifest(out)
    choice = manifest.export_options["exit_layer_choice"]
    assert manifest.exit_layer == choice["layer"] == want
    assert manifest.graph("prefix").layer_range == (0, want) and manifest.graph("suffix").layer_range[0] == want
    assert choice["kind"].startswith("prediction") and "PREDICTED" in choice["table"]
    assert choice["sweep"] == str(sweep) and choice["profile"] == str(profile)
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((DOCS.parent / "manifest.schema.json").read_text())
    jsonschema.validate(json.loads((out / "mirrorsd.json").read_text()), schema)  # the documented schema holds it


def test_given_exit_layer_wins(tiny_model, tmp_path):
    from mirrorsd.export.pipeline import _exit_layer
    from mirrorsd.export.options import ExportOptions

    sweep, profile = inputs(tmp_path, {1: 0.05, 2: 0.3, 3: 0.95})
    options = ExportOptions(model=tiny_model("llama"), output=tmp_path / "x", exit_layer=1, exit_hits=sweep,
                            exit_profile=profile)
    assert _exit_layer(options, LAYERS) == (1, None)


@pytest.mark.parametrize("case", ["half-given", "other-model", "not-json", "no-prefix"])
def test_bad_choice_inputs_are_refused_before_writing(tiny_model, tmp_path, case):
    from mirrorsd.export.options import ExportOptions
    from mirrorsd.export.pipeline import export

    sweep, profile = inputs(tmp_path, {1: 0.1, 3: 0.9}, layers=48 if case == "other-model" else LAYERS)
    if case == "not-json":
        sweep.write_text("{ not json")
    if case == "no-prefix":
        data = json.loads(profile.read_text())
        data["splits"][0].pop("prefix_s")
        profile.write_text(json.dumps(data))
    out = tmp_path / "export"
    options = ExportOptions(model=tiny_model("llama"), output=out, draft_layers=2, exit_hits=sweep,
                            exit_profile=None if case == "half-given" else profile)
    with pytest.raises(ExportOptionError) as info:
        export(options)
    assert info.value.fix and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]
