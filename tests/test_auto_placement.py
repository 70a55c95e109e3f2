"""Mode auto's placement: hand-computed choices between cached profiles of two placements, and a real load that
reopens the draft on OpenVINO's CPU plugin (the stand-in for an NPU here) when its profile predicts that faster.

Not exercised here: a GPU target or an NPU draft (this machine has neither); the choice is the same code for them,
fed by their profiles."""
from __future__ import annotations

import json

import pytest

from mirrorsd.runtime.planner.profile import Profile
from mirrorsd.runtime.planner.placement import choose_placement
from mirrorsd.runtime.planner.threads import SplitRule
from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts

from markers import needs_openvino

CPU = ("cpu", "cpu")
OV = ("cpu", "openvino:CPU")
USELESS = Acceptance(0.0, 0.0, 0.0, "test")  # ar is the best strategy everywhere: 1 token per verify(1)


def profile(verify_ms: float, acceptance: Acceptance | None = USELESS, splits=((2, 2), (1, 1))) -> Profile:
    """A profile whose every split verifies one token in ``verify_ms`` (ar runs at 1000 / verify_ms tok/s)."""
    costs = tuple(SplitCosts(t, d, verify_s=(verify_ms / 1e3,) * 7, exit_s=(0.0,) * 7, draft1_s=0.01,
                             branch_fwd_s=0.01, branch_batch=2) for t, d in splits)
    return Profile(kind="measured", machine="test", splits=costs, acceptance=acceptance)


def test_takes_the_placement_predicted_fastest():
    choice = choose_placement({CPU: profile(100.0), OV: profile(50.0)}, CPU, (2, 2, False))
    assert choice.devices == OV and choice.source == "profile", choice.why
    assert choice.candidates["cpu+cpu"]["tokens_per_second"] == pytest.approx(10.0)
    assert choice.candidates["cpu+openvino:CPU"]["tokens_per_second"] == pytest.approx(20.0)
    assert "2.00x" in choice.why


def test_keeps_the_chain_pick_inside_the_margin_and_without_a_profile():
    kept = choose_placement({CPU: profile(100.0), OV: profile(97.0)}, CPU, (2, 2, False))  # 3 % faster: noise
    assert kept.devices == CPU and "kept" in kept.why
    unmeasured = choose_placement({CPU: profile(100.0), OV: None}, CPU, (2, 2, False))
    assert unmeasured.devices == CPU and "not ranked" in unmeasured.candidates["cpu+openvino:CPU"]
    nothing = choose_placement({CPU: None, OV: profile(10.0)}, CPU, (2, 2, False))  # nothing to compare the pick with
    assert nothing.devices == CPU and nothing.source == "default"


def test_ranks_every_placement_with_the_chain_picks_acceptance():
    """The other profile's own calibration says the draft is perfect; the chain pick's says useless. With one
    acceptance (the pick's) for both, only costs differ: here they are equal, so the pick stays."""
    perfect = Acceptance(0.95, 0.9, 0.9, "test")
    choice = choose_placement({CPU: profile(100.0), OV: profile(100.0, perfect)}, CPU, (2, 2, False))
    assert choice.devices == CPU
    assert choice.candidates["cpu+openvino:CPU"]["best"].startswith("ar")


def test_given_threads_compare_only_that_split():
    fast_1t = profile(100.0, splits=((2, 2),))
    other = Profile(**{**profile(100.0).__dict__, "splits": (
        SplitCosts(2, 2, (0.2,) * 7, (0.0,) * 7, 0.01, 0.01, 2), SplitCosts(1, 1, (0.01,) * 7, (0.0,) * 7, 0.01,
                                                                           0.01, 2))})
    given = choose_placement({CPU: fast_1t, OV: other}, CPU, (2, 2, False), SplitRule(threads=(2, 2)))
    assert given.devices == CPU and given.threads.threads == (2, 2)  # OV's fast 1+1 split is not what was asked
    free = choose_placement({CPU: fast_1t, OV: other}, CPU, (2, 2, False))
    assert free.devices == OV and free.threads.threads == (1, 1)


@pytest.fixture
def profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_PROFILES", str(tmp_path / "profiles"))
    return tmp_path / "profiles"


@needs_openvino  # the second placement here is OpenVINO's CPU plugin
def test_auto_loads_the_placement_its_cached_profiles_predict_fastest(exported, profile_cache, capsys):
    """`mirrorsd devices --profile` measures both placements here (draft on ONNX Runtime CPU and on OpenVINO CPU);
    with the OpenVINO one's costs made faster, a plan_from_profile load opens the draft there, and mode auto's
    tokens equal ar's on the default placement."""
    from mirrorsd.apps.cli import main
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    folder = exported("llama", draft_layers=4)
    assert main(["devices", "--profile", "--model", str(folder), "--threads", "1"]) == 0
    files = {json.loads(p.read_text())["export"]["devices"]["draft"]: p for p in profile_cache.glob("*.json")}
    assert set(files) == {"cpu", "openvino:CPU"}, files  # one profile per placement
    data = json.loads(files["openvino:CPU"].read_text())
    for split in data["splits"]:  # a much faster target on this placement: it wins whatever the acceptance
        for key in ("verify_s", "prefix_s"):  # (the prefix is part of the verification)
            split[key] = [t / 10 for t in split.get(key) or ()]
    files["openvino:CPU"].write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["devices", "--model", str(folder), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "Mode auto loads: cpu+openvino:CPU" in out and out.count("PREDICTED") == 2, out

    config = GenerationConfig(max_new_tokens=24, chat=False)
    with Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1)) as plain:
        reference = plain.generate("def add(a, b):", GenerationConfig(mode="ar", max_new_tokens=24, chat=False))
        assert plain.placements["draft"].backend == "onnxruntime"
    request = DeviceRequest(target_threads=1, draft_threads=1, plan_from_profile=True)
    with Pipeline.load(folder, request) as pipe:
        assert pipe.placements["draft"].backend == "openvino" and pipe.device_strings()["draft"] == "openvino:CPU"
        result = pipe.generate("def add(a, b):", config)
    assert result.tokens == reference.tokens
    assert result.stats.auto["placement"]["chosen"] == "cpu+openvino:CPU", result.stats.auto["placement"]
