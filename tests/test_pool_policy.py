"""How ONNX Runtime's per-session pools wait (devices/backends.py SPINNING_POOL / SLEEPING_POOL): by default the
workers spin within a run and stop at its end; a pipeline for mode mirror, whose draft runs beside the target, gets
pools that sleep between sections. Checked on real sessions: the options each one was opened with, the placements
and the profile cache key that say which, the CLI and the bench opening the right pipeline per mode, and tokens
equal to ar either way. The speed it buys is measured by the bench (docs/performance.md), not here."""
from __future__ import annotations

import json

import pytest

from mirrorsd.devices.backends import SLEEPING_POOL, SPINNING_POOL, OrtSession, SessionSettings
from mirrorsd.devices.placement import SLEEPING_POOL_MARK, DeviceRequest
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


def test_pools_spin_within_a_run_and_stop_at_its_end_unless_asked_to_sleep():
    assert entries(SessionSettings(threads=2)) == dict(SPINNING_POOL) == {SPIN: "1", STOP: "1"}
    assert entries(SessionSettings(threads=2, spin_in_run=False)) == dict(SLEEPING_POOL) == {SPIN: "0"}


def test_only_the_modes_that_run_two_sessions_at_once_sleep():
    assert [m for m in (*MODES, "auto") if not spins_in_run(m)] == ["mirror"]


def test_placements_and_the_profile_cache_say_which_pool(exported):
    from mirrorsd.runtime.planner.profile import cache_path

    folder = exported("llama")
    with Pipeline.load(folder) as spinning, Pipeline.load(folder, DeviceRequest(spin_in_run=False)) as sleeping:
        assert not any(SLEEPING_POOL_MARK in where for where in spinning.placement.values())
        assert all(where.endswith(SLEEPING_POOL_MARK) for where in sleeping.placement.values()), sleeping.placement
        assert all(p.sleeping_pool for p in sleeping.placements.values())
        assert cache_path(folder, spinning.placement) != cache_path(folder, sleeping.placement)
        prompt = [1, 17, 42, 99, 7, 250, 3]
        want = spinning.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=12)).tokens
        for mode in ("sd", "mirror"):
            for pipe in (spinning, sleeping):
                assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=12, gamma=3)).tokens == want


@pytest.mark.parametrize("mode, sleeps", [("mirror", True), ("sd", False)])
def test_generate_opens_sleeping_pools_for_mirror_only(exported, capsys, mode, sleeps):
    from mirrorsd.apps.cli import main

    assert main(["generate", "--model", str(exported("llama")), "--mode", mode, "--max-new-tokens", "6",
                 "--prompt", "hello", "--json"]) == 0
    placement = json.loads(capsys.readouterr().out)["stats"]["placement"]
    assert placement and all((SLEEPING_POOL_MARK in where) == sleeps for where in placement.values()), placement


def test_bench_runs_mirror_on_sleeping_pools_and_the_rest_spinning(exported, tmp_path):
    from mirrorsd.apps.bench import BenchOptions, run_bench

    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "coding", "turns": ["Write a loop."]}))
    result = run_bench(BenchOptions(model=exported("llama"), modes=("ar", "sd", "mirror", "mirror-noexit"),
                                    questions=questions, categories=("coding",), per_category=1, max_new_tokens=6,
                                    output=tmp_path / "out", warmup=False, bandwidth=False), progress=False)
    sleeps = {run.mode: all(SLEEPING_POOL_MARK in where for where in run.stats["placement"].values())
              for run in result.runs}
    assert sleeps == {"ar": False, "sd": False, "mirror": True, "mirror-noexit": True}, result.runs[0].stats
    assert all(run.parity == "identical" for run in result.runs if run.mode != "ar")
