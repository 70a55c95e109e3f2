"""The shared thread pool (devices/thread_pool.py): every ONNX Runtime CPU session of the process on one spinning
pool, opt-in, and taken by mode auto where the cached profile predicts it faster. ONNX Runtime holds a process to
the pool once it exists (its size, and no session with threads of its own beside it), so the loads run in a child
process: ar, sd and mirror on the shared pool equal ar on per-session pools; the placements say which pool they run
on; auto keeps per-session pools or opens on the shared pool as the profile predicts (while another pipeline on
per-session pools stays open); after that, a default load joins the pool, and pools of their own or another size
are refused with a clear error. The choice rules are checked by hand too. Speed is measured by the bench
(docs/performance.md), not here."""
from __future__ import annotations

import os
import subprocess
import sys

from mirrorsd.devices.thread_pool import resolve
from mirrorsd.runtime.planner.profile import Profile, from_json
from mirrorsd.runtime.planner.threads import SplitRule, choose_split
from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, split_name

USELESS = Acceptance(0.0, 0.0, 0.0, "test")  # ar is every split's best strategy: 1 token per verify(1)


def costs(t: int, d: int, shared: bool, verify_ms: float) -> SplitCosts:
    return SplitCosts(t, d, verify_s=(verify_ms / 1e3,) * 7, exit_s=(0.0,) * 7, draft1_s=0.01, branch_fwd_s=0.01,
                      branch_batch=2, shared_pool=shared)


def test_the_pool_is_opt_in_and_binds_the_process_once_it_exists():
    from mirrorsd.errors import DeviceError

    assert not resolve(None, (2, 2), None) and resolve(True, (2, 1), None) and not resolve(False, (2, 2), None)
    assert resolve(None, (2, 2), 2) and resolve(True, (2, 2), 2)  # the process's pool exists: every session joins
    for requested, threads in ((False, (2, 2)), (None, (1, 1)), (None, (2, 1))):
        try:
            resolve(requested, threads, 2)
        except DeviceError as exc:
            assert "shared pool of 2 threads" in exc.what and "2 threads" in exc.fix, exc
        else:
            raise AssertionError(f"{requested} {threads} beside a pool of 2 was not refused")


def test_auto_ranks_the_shared_pool_as_a_split_of_its_own():
    profile = Profile("measured", "test", (costs(2, 2, False, 100.0), costs(2, 2, True, 80.0),
                                           costs(1, 1, False, 120.0)))
    assert [s.split for s in profile.splits] == ["2+2", "2 shared", "1+1"] and split_name(2, 1, True) == "2+1 shared"
    assert profile.split(2, 2, True).verify_s[0] == 0.08 and profile.split(2, 2).verify_s[0] == 0.1
    choice = choose_split(profile, USELESS, (2, 2, False))
    assert choice.key == (2, 2, True) and choice.split == "2 shared", choice.why
    kept = choose_split(profile, USELESS, (2, 2, True))
    assert kept.key == (2, 2, True) and "kept" in kept.why
    # the process holds a pool: only a shared split of its size can open (none of size 1 here: the default stays)
    assert choose_split(profile, USELESS, (2, 2, True), SplitRule(pool_size=2)).key == (2, 2, True)
    assert choose_split(profile, USELESS, (1, 1, True), SplitRule(pool_size=1)).source == "default"
    no_pool = SplitRule(shared=False)  # --no-shared-pool
    assert choose_split(profile, USELESS, (2, 2, True), no_pool).key == (2, 2, False)
    assert choose_split(profile, USELESS, (1, 1, False), SplitRule(threads=(1, 1))).key == (1, 1, False)
    assert from_json(profile.to_json()).split(2, 2, True) == profile.split(2, 2, True)  # the key survives the file


CHILD = r'''
import sys
from mirrorsd.runtime.planner import profile as profiles
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.errors import DeviceError
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts

folder, threads = sys.argv[1], int(sys.argv[2])
prompt = [1, 17, 42, 99, 7]
config = lambda mode: GenerationConfig(mode=mode, max_new_tokens=24, chat=False)
pooled = lambda pipe: [("shared pool" in p.describe()) for p in pipe.placements.values()]
# pools of their own that spin within a run: the placement whose profile file holds the shared split too (a planned
# load opens those, as `mirrorsd devices --profile` measures them)
own = lambda: DeviceRequest(target_threads=threads, draft_threads=threads, spin_in_run=True)
plain = Pipeline.load(folder, own())  # stays open while auto opens the shared pool below
reference = plain.generate(prompt, config("ar")).tokens
assert not any(pooled(plain)) and not plain.shared_pool  # the default: pools of their own


def cache_profile(shared_ms, own_ms):  # ar's step on each kind of pool (the costs are made up; acceptance 0)
    path = profiles.cache_path(plain.folder, {r: pl.describe() for r, pl in plain.placements.items()})
    splits = tuple(SplitCosts(threads, threads, (ms / 1e3,) * 7, (0.0,) * 7, 0.01, 0.01, 2, shared_pool=shared)
                   for shared, ms in ((True, shared_ms), (False, own_ms)))
    profiles.save(profiles.Profile("measured", "test", splits, Acceptance(0.0, 0.0, 0.0, "test"),
                                   detail=({}, {})), path)


cache_profile(shared_ms=100.0, own_ms=50.0)
with Pipeline.load(folder, DeviceRequest(plan_from_profile=True)) as auto:
    chosen = auto.planner.thread_choice
    assert not auto.shared_pool and chosen.split == f"{threads}+{threads}", chosen
cache_profile(shared_ms=50.0, own_ms=100.0)
with Pipeline.load(folder, DeviceRequest(plan_from_profile=True, shared_pool=False)) as auto:
    assert not auto.shared_pool, auto.planner.thread_choice  # --no-shared-pool: auto stays off it
with Pipeline.load(folder, DeviceRequest(plan_from_profile=True)) as auto:
    assert auto.shared_pool and all(pooled(auto)), auto.planner.thread_choice  # the process's first pool: auto's size
    assert auto.planner.thread_choice.split == f"{threads} shared", auto.planner.thread_choice
    assert auto.generate(prompt, config("auto")).tokens == reference
assert plain.generate(prompt, config("mirror")).tokens == reference  # opened before the pool: still runs
plain.close()

with Pipeline.load(folder, own()) as pipe:  # the default, now that the process holds a pool: it joins
    assert all(pooled(pipe)), pipe.placements
    for mode in ("ar", "sd", "mirror"):
        tokens = pipe.generate(prompt, config(mode)).tokens
        assert tokens == reference, (mode, tokens, reference)
refusals = [DeviceRequest(target_threads=threads, draft_threads=threads, shared_pool=False)]
refusals += [DeviceRequest(target_threads=1, draft_threads=1, shared_pool=True)] if threads > 1 else []
for request in refusals:
    try:
        Pipeline.load(folder, request)
    except DeviceError as exc:
        assert "shared pool" in exc.what and exc.fix, exc
    else:
        raise SystemExit(f"{request} was not refused beside the process's pool")
print("ok")
'''


def test_shared_pool_auto_and_refusals_in_a_child_process(exported, tmp_path):
    folder = exported("llama", draft_layers=2)
    threads = min(2, os.cpu_count() or 1)
    env = {**os.environ, "MIRRORSD_PROFILES": str(tmp_path / "profiles")}
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(threads)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
