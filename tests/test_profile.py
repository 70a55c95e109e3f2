"""Device profiles: the JSON schema (strict), the cache, `mirrorsd devices --profile` and `mirrorsd plan`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mirrorsd.runtime.planner import profile as profiles
from mirrorsd.errors import ProfileError
from mirrorsd.runtime.planner.latency import Strategy, predict

DOCS = Path(__file__).resolve().parent.parent / "docs" / "profiles"


@pytest.fixture(autouse=True)
def profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_PROFILES", str(tmp_path / "profiles"))


@pytest.mark.parametrize("name", ["lunar-lake-258v.json", "rtx4060-laptop-npu.json"])
def test_example_profiles_load_and_cite_their_sources(name):
    profile = profiles.load(DOCS / name)
    assert profile.kind == "hand-written" and profile.sources and profile.notes
    assert profile.acceptance is not None


def test_lunar_lake_profile_reproduces_the_published_serial_runs():
    """The hand-written profile's serial predictions stay within 15 % of the published OpenVINO runs."""
    profile = profiles.load(DOCS / "lunar-lake-258v.json")
    by_name = {s.name: s for s in profile.splits}
    published = [("gpu+npu", 1, 9.0), ("gpu+npu", 3, 7.1), ("gpu+npu", 5, 6.7), ("gpu+cpu", 3, 16.5)]
    for split, gamma, tok_s in published:
        got = predict(by_name[split], Strategy("sd", gamma), profile.acceptance).tokens_per_second
        assert abs(got - tok_s) / tok_s <= 0.15, (split, gamma, got, tok_s)
    assert predict(by_name["gpu+npu"], Strategy("ar"), profile.acceptance).tokens_per_second == pytest.approx(
        12.2, rel=0.01)


def test_profile_json_is_strict():
    good = json.loads((DOCS / "rtx4060-laptop-npu.json").read_text())
    assert profiles.from_json(good).splits[0].name == "cuda+npu"
    with pytest.raises(ProfileError, match="schema"):
        profiles.from_json({**good, "schema": "mirrorsd-profile/0"})
    with pytest.raises(ProfileError, match="unknown keys"):
        profiles.from_json({**good, "speed": 3})
    split = dict(good["splits"][0])
    with pytest.raises(ProfileError, match="unknown keys"):
        profiles.from_json({**good, "splits": [{**split, "gpu": 1}]})
    with pytest.raises(ProfileError, match="contention"):
        profiles.from_json({**good, "splits": [{**split, "c_target": 0.5}]})
    with pytest.raises(ProfileError, match="contention"):  # (JSON as Python writes it can hold Infinity)
        profiles.from_json({**good, "splits": [{**split, "c_draft": float("inf")}]})
    with pytest.raises(ProfileError, match="seconds"):
        profiles.from_json({**good, "splits": [{**split, "draft1_s": float("inf")}]})
    with pytest.raises(ProfileError, match="one entry per window width"):
        profiles.from_json({**good, "splits": [{**split, "exit_s": [0.01]}]})
    with pytest.raises(ProfileError, match="incomplete"):
        profiles.from_json({**good, "splits": [{k: v for k, v in split.items() if k != "draft1_s"}]})


def test_plan_command_prints_predictions(capsys):
    from mirrorsd.apps.cli import main

    assert main(["plan", "--profile", str(DOCS / "rtx4060-laptop-npu.json")]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "cuda+npu" in out
    assert "fastest: mirror" in out  # a slow NPU draft beside a slow target: the draft hides under the target
    assert main(["plan", "--profile", str(DOCS / "lunar-lake-258v.json"), "--alpha", "0.0"]) == 0
    assert "fastest: ar" in capsys.readouterr().out


def test_devices_profile_measures_caches_and_prints_the_table(exported, capsys):
    from mirrorsd.apps.cli import main

    folder = exported("llama", draft_layers=4)
    assert main(["devices", "--profile", "--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "fastest:" in out
    from mirrorsd.devices.placement import DeviceRequest, placement_candidates
    from mirrorsd.manifest import load_manifest

    files = list(Path(os.environ["MIRRORSD_PROFILES"]).glob("*.json"))
    pairs = placement_candidates(load_manifest(folder), DeviceRequest())  # here: the draft on cpu, openvino:CPU
    assert len(files) == len(pairs)  # one file per export and device set, every thread split inside
    profile = profiles.cached_by_devices(folder)[pairs[0]]
    assert profile.kind == "measured" and profile.acceptance.source == "calibration"
    splits = {s.split for s in profile.splits}
    n = max(1, os.cpu_count() or 1)
    assert "1+1" in splits and f"{n} shared" in splits, splits  # the shared pool: measured in a child process
    for s in profile.splits:
        assert len(s.verify_s) == len(s.exit_s) == 7 and all(t > 0 for t in s.verify_s)
        assert s.draft1_s > 0 and s.branch_fwd_s > 0 and s.c_target >= 1 and s.c_draft >= 1
    assert main(["devices", "--model", str(folder), "--threads", "1"]) == 0  # read back, nothing measured
    assert "PREDICTED" in capsys.readouterr().out
    from mirrorsd.runtime.planner.profiling import CALIBRATION_PROMPTS

    assert profile.calibration["prompts"] == len(CALIBRATION_PROMPTS) == 6  # one per SpecBench category


def test_devices_says_what_to_run_when_nothing_is_profiled(exported, capsys):
    from mirrorsd.apps.cli import main

    assert main(["devices", "--model", str(exported("llama", draft_layers=4))]) == 0
    out = capsys.readouterr().out
    assert "No profile of this export on this machine yet" in out and "PREDICTED" not in out


def test_an_acceptance_calibrated_on_other_prompts_is_measured_again(exported):
    """A cached profile whose acceptance came from another prompt set (an older mirrorsd's two prompts) is
    calibrated again; its measured costs are kept."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner.profiling import CALIBRATION_PROMPTS

    folder = exported("llama", draft_layers=4)
    with Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1)) as pipe:
        first = pipe.profile()
        path = profiles.cache_path(pipe.folder, {role: p.describe() for role, p in pipe.placements.items()})
        data = json.loads(path.read_text())
        data["calibration"]["prompts"] = 2
        data["acceptance"]["alpha"] = 0.123
        path.write_text(json.dumps(data))
        pipe.planner.loaded = None  # forget the loaded one: read the cache as a new process would
        again = pipe.profile()
    assert again.calibration["prompts"] == len(CALIBRATION_PROMPTS)
    assert again.acceptance.alpha != 0.123 and again.acceptance.source == "calibration"
    assert again.splits[0].verify_s == first.splits[0].verify_s  # the costs were not measured again


def with_sparse_exit(folder: Path, out: Path) -> Path:
    """A copy of export ``folder`` with an (untrained) sparse exit head beside its full one, as mirrorsd-train-exit
    writes it."""
    import shutil
    from dataclasses import replace as dc_replace

    import onnx

    from mirrorsd import names
    from mirrorsd.export.early_exit import graph
    from mirrorsd.export.early_exit.train import _sparse_spec
    from mirrorsd.manifest import load_manifest

    shutil.copytree(folder, out)
    manifest = load_manifest(out)
    head = onnx.load(str(out / manifest.graph(names.EXIT_HEAD).file))
    weight, bias = graph.head_weight(head, manifest.target.hidden_size)
    spec = _sparse_spec(manifest)
    onnx.save(graph.sparse_head(head, weight, bias), str(out / spec.file))
    dc_replace(manifest, graphs={**manifest.graphs, names.EXIT_SPARSE: spec}).save(out)
    return out


def test_profile_times_the_sparse_exit_head_when_the_folder_has_one(exported, tmp_path):
    """Mirror-SD runs the sparse exit head where the folder has one: the profile's exit_s is that head's time (its
    session ran during the measurement), and the full head's time is kept beside it in the detail."""
    from mirrorsd import names
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner.profiling import measure_split

    folder = with_sparse_exit(exported("llama", draft_layers=4), tmp_path / "sparse")
    with Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1)) as pipe:
        assert pipe.target.exit_sparse is not None
        sparse_runs = pipe.sessions[names.EXIT_SPARSE].timeline  # shared with the target's other graphs
        full = pipe.sessions[names.EXIT_HEAD]
        calls = {"sparse": 0, "full": 0}
        for key, session in (("sparse", pipe.sessions[names.EXIT_SPARSE]), ("full", full)):
            run = session.run

            def counted(feeds, run=run, key=key):
                calls[key] += 1
                return run(feeds)

            session.run = counted
        costs, detail = measure_split(pipe.planner_view(), max_gamma=2, repeats=2)
        assert sparse_runs is pipe.target_timeline
    assert detail["exit_head"] == "sparse" and "sparse exit head" in costs.label
    assert len(detail["exit_full_s"]) == len(costs.exit_s) == 3
    widths, rounds = 3, 2 + 1  # warm-up included
    assert calls["sparse"] >= widths * rounds  # exit_s: the sparse head, at every width
    assert calls["full"] == widths * rounds  # the full head only for the detail's exit_full_s
    assert detail["exit_layer"] == pipe.manifest.exit_layer and detail["layers"] == 4


def test_profile_without_a_sparse_head_times_the_full_one(exported):
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner.profiling import measure_split

    with Pipeline.load(exported("llama", draft_layers=4), DeviceRequest(target_threads=1, draft_threads=1)) as pipe:
        costs, detail = measure_split(pipe.planner_view(), max_gamma=2, repeats=1)
    assert detail["exit_head"] == "full" and "exit_full_s" not in detail and "full exit head" in costs.label


def test_plan_prints_the_exit_layer_table(tmp_path, capsys):
    """`mirrorsd plan --exit-hits SWEEP.json`: Mirror-SD's predicted speed per exit layer from the profile's prefix
    times, and the best layer; a split without prefix times says what it lacks."""
    from mirrorsd.apps.cli import main
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table, read_hits

    data = json.loads((DOCS / "rtx4060-laptop-npu.json").read_text())
    split = data["splits"][0]
    with_prefix = {**split, "prefix_s": [v / 2 for v in split["verify_s"]], "detail": {"exit_layer": 24, "layers": 48}}
    data["splits"] = [with_prefix, {**split, "name": "no-prefix"}]
    profile_file = tmp_path / "profile.json"
    profile_file.write_text(json.dumps(data))
    sweep = {"layers": 48, "results": [{"layer": L, "trained": {"1": h / 2, "4": h, "8": h}, "untrained": {}}
                                       for L, h in ((12, 0.2), (24, 0.45), (36, 0.7))]}
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(json.dumps(sweep))
    assert main(["plan", "--profile", str(profile_file), "--exit-hits", str(sweep_file)]) == 0
    out = capsys.readouterr().out
    assert "Mirror-SD against the exit layer (PREDICTED" in out and "| 36/48 |" in out
    assert "no-prefix: no exit-layer table" in out
    loaded = profiles.load(profile_file)
    hits, _ = read_hits(sweep)
    best = exit_layer_table(loaded.splits[0], loaded.acceptance, hits, 24)[0]
    assert f"best exit layer: {best.layer} ({best.tokens_per_second:.1f} tok/s" in out
    bad = {**data, "splits": [{**with_prefix, "prefix_s": [1.0] * 7}]}
    with pytest.raises(ProfileError, match="prefix_s"):
        profiles.from_json(bad)


def test_exit_layer_sweep_suggests_the_latency_models_layer(tmp_path):
    """mirrorsd-exit-sweep's suggestion is the latency model's best layer (no heuristic)."""
    pytest.importorskip("torch")
    from mirrorsd.export.early_exit import sweep

    data = json.loads((DOCS / "rtx4060-laptop-npu.json").read_text())
    split = data["splits"][0]
    data["splits"] = [{**split, "prefix_s": [v / 2 for v in split["verify_s"]], "detail": {"exit_layer": 24}}]
    (tmp_path / "p.json").write_text(json.dumps(data))
    text = sweep.suggestion(tmp_path / "p.json", None, {12: 0.2, 24: 0.45, 36: 0.7}, 48)
    assert "best exit layer:" in text and "PREDICTED" in text
    assert "pass --profile" in sweep.suggestion(None, None, {12: 0.2}, 48)


def test_profile_cache_is_per_kernel_build(tmp_path, monkeypatch):
    """A profile measured with one build of mirrorsd's kernel library is not read for another (a kernel change can
    move the costs by half); placements without those kernels do not depend on the build."""
    from mirrorsd.devices import kernels

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "mirrorsd.json").write_text("{}")
    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "profiles"))
    with_kernels = {"prefix": "ort:CPU [mirrorsd kernels]", "draft": "ort:CPU [mirrorsd kernels]"}
    without = {"prefix": "ort:CPU", "draft": "ort:CPU"}
    paths = {}
    for build in ("avx2/aaaa", "avx2/bbbb"):
        monkeypatch.setattr(kernels, "build_id", lambda build=build: build)
        paths[build] = (profiles.cache_path(folder, with_kernels), profiles.cache_path(folder, without))
    assert paths["avx2/aaaa"][0] != paths["avx2/bbbb"][0]
    assert paths["avx2/aaaa"][1] == paths["avx2/bbbb"][1]
