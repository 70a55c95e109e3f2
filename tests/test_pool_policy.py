"""How ONNX Runtime's per-session pools wait (devices/backends.py SPINNING_POOL / SLEEPING_POOL): by default their
workers sleep between parallel sections; `mirrorsd generate`, `mirrorsd devices` and `mirrorsd bench` open pools
that spin within a run and stop at its end for every mode but mirror, whose draft runs beside the target. Checked on
real sessions: the options each one is opened with, the placements and the profile cache key that say which, auto's
placement predicted before opening, the CLI and the bench opening the right pipeline per mode, and tokens equal to
ar either way. The speed it buys is measured by the bench (docs/performance.md), not here."""
from __future__ import annotations

import json

import pytest

from mirrorsd.devices.backends import SLEEPING_POOL, SPINNING_POOL, OrtSession, SessionSettings
from mirrorsd.devices.placement import SPINNING_POOL_MARK, DeviceRequest, plan_placement
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.config import MODES, spins_in_run

SPIN, STOP = "session.intra_op.allow_spinning", "session.force_spinning_stop"


def entries(settings: SessionSettings) -> dict[str, str]:
    options = OrtSession._options(settings)
    found = {}
    for key in (SPIN, STOP):
        try:
            found[key] = options.get_session_config_entry(key)
        except RuntimeError:  # ONNX Runtime's answer for a key that was never set
            pass
    return found


def spinning(placement: dict[str, str]) -> set[bool]:
    return {SPINNING_POOL_MARK in where for where in placement.values()}


def test_pools_sleep_unless_asked_to_spin_within_a_run():
    assert entries(SessionSettings(threads=2)) == dict(SLEEPING_POOL) == {SPIN: "0"}
    assert entries(SessionSettings(threads=2, spin_in_run=True)) == dict(SPINNING_POOL) == {SPIN: "1", STOP: "1"}


def test_only_the_modes_that_run_two_sessions_at_once_sleep():
    assert [m for m in (*MODES, "auto") if not spins_in_run(m)] == ["mirror"]


def test_a_load_planned_from_profiles_spins_like_the_cli(exported):
    """`mirrorsd devices --profile` measures spinning pools, so a planned library load opens those (and finds them)."""
    folder = exported("llama")
    with Pipeline.load(folder, DeviceRequest(plan_from_profile=True)) as planned:
        assert spinning(planned.placement) == {True}, planned.placement
    with Pipeline.load(folder, DeviceRequest(plan_from_profile=True, spin_in_run=False)) as asked:
        assert spinning(asked.placement) == {False}, asked.placement


def test_placements_profile_key_and_auto_prediction_say_which_pool(exported):
    from mirrorsd.runtime.planner.loading import predicted_placement
    from mirrorsd.runtime.planner.profile import cache_path

    folder = exported("llama")
    with Pipeline.load(folder) as sleeping, Pipeline.load(folder, DeviceRequest(spin_in_run=True)) as spinning_pipe:
        assert spinning(sleeping.placement) == {False} and spinning(spinning_pipe.placement) == {True}
        assert all(p.spinning_pool for p in spinning_pipe.placements.values())
        assert cache_path(folder, sleeping.placement) != cache_path(folder, spinning_pipe.placement)
        for pipe, spin in ((sleeping, False), (spinning_pipe, True)):  # what auto reads before opening = what opens
            plan = plan_placement(pipe.manifest, DeviceRequest(spin_in_run=spin))
            assert predicted_placement(folder, pipe.manifest, plan, False, spin) == pipe.placement
        prompt = [1, 17, 42, 99, 7, 250, 3]
        want = sleeping.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=12)).tokens
        for mode in ("ar", "sd", "mirror"):
            for pipe in (sleeping, spinning_pipe):
                assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=12, gamma=3)).tokens == want


@pytest.mark.parametrize("mode, spins", [("mirror", False), ("sd", True), ("ar", True)])
def test_generate_spins_for_every_mode_but_mirror(exported, capsys, mode, spins):
    from mirrorsd.apps.cli import main

    assert main(["generate", "--model", str(exported("llama")), "--mode", mode, "--max-new-tokens", "6",
                 "--prompt", "hello", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["stats"]["placement"]
    assert placement and spinning(placement) == {spins}, placement


def test_bench_runs_mirror_on_sleeping_pools_and_the_rest_spinning(exported, tmp_path):
    from mirrorsd.apps.bench import BenchOptions, run_bench

    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "coding", "turns": ["Write a loop."]}))
    result = run_bench(BenchOptions(model=exported("llama"), modes=("ar", "sd", "mirror", "mirror-noexit"),
                                    questions=questions, categories=("coding",), per_category=1, max_new_tokens=6,
                                    output=tmp_path / "out", warmup=False, bandwidth=False), progress=False)
    spins = {run.mode: spinning(run.stats["placement"]) for run in result.runs}
    assert spins == {"ar": {True}, "sd": {True}, "mirror": {False}, "mirror-noexit": {False}}, spins
    assert all(run.parity == "identical" for run in result.runs if run.mode != "ar")
