"""Mode auto on tiny models: it measures a profile, picks ar for a useless draft and a speculative mode for a
perfect one, stays exact, and keeps token parity with ar when it switches modes in the middle of a generation."""
from __future__ import annotations

import pytest

from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.planner.auto import AutoProposer
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.planner.latency import Strategy
from mirrorsd.runtime.planner.planner import concrete
from mirrorsd.runtime.sampling import GREEDY

PROMPT = "def add(a, b):"
TOKENS = 40


@pytest.fixture(autouse=True)
def profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_PROFILES", str(tmp_path / "profiles"))  # profiles of tmp exports stay in tmp


@pytest.fixture(scope="module")
def same_draft(exported):
    return exported("llama", draft_layers=4)  # the draft is the whole target: every draft token is accepted


@pytest.fixture(scope="module")
def random_draft(exported, tiny_model):
    return exported("llama", draft=tiny_model("llama", layers=2, seed=7))  # another random model


@pytest.fixture(scope="module")
def single_thread():
    """Pipelines with one thread per session: on this 2-core machine the draft then runs beside the target, not
    against it (a tiny model's draft costs as much as the target; only running it concurrently can pay)."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline

    loaded = {}

    def get(folder):
        if folder not in loaded:
            loaded[folder] = Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1))
        return loaded[folder]

    yield get
    for pipe in loaded.values():
        pipe.close()


def generate(pipe, mode: str, **kw):
    return pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=TOKENS, chat=False, **kw))


def with_costs(pipe, **costs):
    """The pipeline's measured profile (its calibrated acceptance kept), with fixed costs in place of the measured
    ones: a target whose window costs what one row costs and a draft at 1/10 of it (a GPU target, an NPU draft).
    On tiny models every graph call costs about the same (overhead-bound), so the measured costs alone leave ar and
    speculation within noise of each other; fixing the costs makes the choice depend on the acceptance only."""
    from dataclasses import replace

    from mirrorsd.runtime.planner.latency import SplitCosts

    measured = pipe.profile()
    split = SplitCosts(target_threads=pipe.threads[0], draft_threads=pipe.threads[1], verify_s=(0.010,) * 7,
                       exit_s=(0.001,) * 7, draft1_s=0.001, branch_fwd_s=0.0012, branch_batch=2, **costs)
    pipe.use_profile(replace(measured, splits=(split,), detail=({},)))
    return measured


def test_auto_is_the_default_and_picks_speculation_when_the_draft_is_the_target(same_draft, single_thread):
    pipe = single_thread(same_draft)
    assert GenerationConfig().mode == "auto"
    measured = with_costs(pipe)
    assert measured.acceptance.alpha > 0.9 and measured.acceptance.source == "calibration"
    ar = generate(pipe, "ar")
    auto = pipe.generate(PROMPT, GenerationConfig(max_new_tokens=TOKENS, chat=False))
    assert auto.tokens == ar.tokens
    report = auto.stats.auto
    assert auto.stats.mode == "auto"
    assert report["chosen"].split()[0] in ("sd", "mirror", "mirror-noexit"), (report["why"], report["table"])
    assert auto.stats.accepted > 0  # it really drafted
    print(report["why"])


def test_auto_picks_ar_when_the_draft_is_useless(random_draft, single_thread):
    pipe = single_thread(random_draft)
    measured = with_costs(pipe)
    assert measured.acceptance.alpha < 0.3
    ar = generate(pipe, "ar")
    auto = generate(pipe, "auto")
    assert auto.tokens == ar.tokens
    report = auto.stats.auto
    assert report["chosen"].startswith("ar"), report
    assert auto.stats.drafted == 0
    print(report["why"])


def test_auto_on_measured_costs_stays_exact(same_draft, random_draft, pipelines):
    """With the costs it measured itself (whatever it picks on a tiny model), auto emits ar's tokens."""
    for folder in (same_draft, random_draft):
        pipe = pipelines(folder)
        auto = generate(pipe, "auto")
        assert auto.tokens == generate(pipe, "ar").tokens
        assert auto.stats.auto["table"]["predicted"], auto.stats.auto


class Scripted(AutoProposer):
    """Switches to the next strategy of ``script`` every ``every`` steps (the re-planner's move, on a schedule)."""

    def __init__(self, *args, script, every=3, **kw):
        super().__init__(*args, **kw)
        self.script, self.every, self.seen = list(script), every, []

    def observe(self, verdict, new_tokens, next_gamma):
        self.seen.append(self.strategy)
        super().observe(verdict, new_tokens, next_gamma)
        if self._step % self.every == 0 and self.script:
            self.switch_to(self.script.pop(0))


@pytest.mark.parametrize("draft", ["same", "random"])
def test_switching_modes_mid_generation_keeps_parity_with_ar(draft, same_draft, random_draft, pipelines):
    pipe = pipelines(same_draft if draft == "same" else random_draft)
    config = GenerationConfig(max_new_tokens=TOKENS, chat=False)
    ids = pipe.encode(PROMPT, config)
    reference = generate(pipe, "ar").tokens
    script = [Strategy("sd", 3), Strategy("mirror", 4), Strategy("ar"), Strategy("mirror", 2, exit_head=False),
              Strategy("sd", 5), Strategy("mirror", 6), Strategy("ar"), Strategy("sd", 1),
              Strategy("sd", 6, confidence=0.3), Strategy("sd", 4, confidence=0.7)] * 2
    profile = pipe.profile()
    proposer = Scripted(lambda s: pipe._proposer(concrete(config, s)), pipe.planner.costs(pipe.thread_key),
                        profile.acceptance, script=script, every=2)
    settings = DecodeSettings(TOKENS, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit,
                              proposer.costs.max_gamma, sampler=GREEDY)
    try:
        outcome = decode(pipe.target, proposer, ids, settings)
    finally:
        proposer.close()
    assert outcome.tokens == reference
    modes = {s.mode for s in proposer.seen}
    assert modes == {"ar", "sd", "mirror"}, proposer.seen  # every mode really ran a step


def test_replans_to_ar_when_acceptance_collapses(random_draft, pipelines):
    """Told that the draft is perfect, auto starts speculating; its measured speed then falls short, and it
    re-plans with the acceptance it measured: a strategy without the draft (ar, or ngram where the lookup replay on
    the text so far predicts copied windows to pay: with these costs a window costs what a row costs)."""
    from dataclasses import replace

    pipe = pipelines(random_draft)
    config = GenerationConfig(max_new_tokens=80, chat=False)
    with_costs(pipe)  # fixed costs: with measured ones a loaded machine could make even a perfect draft lose
    profile = pipe.profile()
    optimistic = replace(profile.acceptance, alpha=0.99, reuse=0.99, reuse_noexit=0.99, source="test")
    costs = pipe.planner.costs(pipe.thread_key)
    proposer = AutoProposer(lambda s: pipe._proposer(concrete(config, s)), costs, optimistic)
    assert proposer.strategy.mode != "ar", (proposer.costs, proposer.first_table.to_dict())
    settings = DecodeSettings(80, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit,
                              proposer.costs.max_gamma, sampler=GREEDY)
    try:
        outcome = decode(pipe.target, proposer, pipe.encode(PROMPT, config), settings)
    finally:
        proposer.close()
    assert outcome.tokens == pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=80, chat=False)).tokens
    assert proposer.switches, "no re-plan"
    assert proposer.strategy.mode in ("ar", "ngram"), proposer.report()
    assert proposer.report()["switches"][0]["new"].split()[0] in ("ar", "ngram")


# ---- the thread split (runtime/planner/threads.py) -------------------------------------------------------------------
def split_costs(t: int, d: int, verify: float, draft1: float, contention: float = 1.0):
    from mirrorsd.runtime.planner.latency import SplitCosts

    return SplitCosts(target_threads=t, draft_threads=d, verify_s=(verify,) * 7, exit_s=(0.001,) * 7,
                      draft1_s=draft1, branch_fwd_s=1.2 * draft1, branch_batch=2, c_target=contention,
                      c_draft=contention)


def cache_profile(folder, splits, alpha: float):
    """A profile with ``splits`` in the cache of ``folder`` on this machine's placement (what `mirrorsd devices
    --profile` would have written), with a fixed acceptance."""
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner.latency import Acceptance

    # spinning pools, as `mirrorsd devices` measures them and a planned load opens them
    with Pipeline.load(folder, DeviceRequest(target_threads=1, draft_threads=1, spin_in_run=True)) as pipe:
        path = profiles.cache_path(pipe.folder, {r: p.describe() for r, p in pipe.placements.items()})
    profiles.save(profiles.Profile(kind="measured", machine="test", splits=tuple(splits), detail=({},) * len(splits),
                                   acceptance=Acceptance(alpha, alpha, alpha, "test")), path)
    return path


def cores() -> int:
    from mirrorsd.devices.backends import default_threads

    n = default_threads()
    if n < 2:
        pytest.skip("one core: there is only one thread split")
    return n


def test_choose_split_by_hand():
    """The split whose best strategy is fastest; the current one kept within KEEP_MARGIN; no acceptance: default."""
    from mirrorsd.runtime.planner.profile import Profile
    from mirrorsd.runtime.planner.threads import choose_split
    from mirrorsd.runtime.planner.latency import Acceptance

    both = split_costs(2, 2, verify=0.009, draft1=0.004, contention=2.0)  # ar 111 tok/s
    one = split_costs(1, 1, verify=0.010, draft1=0.001)  # ar 100 tok/s; mirror hides its cheap draft
    profile = Profile("measured", "test", (both, one))
    good, useless = Acceptance(0.9, 0.9, 0.9, "test"), Acceptance(0.0, 0.0, 0.0, "test")
    choice = choose_split(profile, good, (2, 2, False))
    assert choice.threads == (1, 1) and choice.source == "profile", choice
    assert choice.candidates["1+1"]["best"].startswith("mirror") and choice.candidates["2+2"]["best"].startswith("sd")
    assert choose_split(profile, useless, (1, 1, False)).threads == (2, 2)  # ar: 111 > 1.05 x 100
    close = Profile("measured", "test", (split_costs(2, 2, 0.0098, 0.004, 2.0), one))
    kept = choose_split(close, useless, (1, 1, False))  # ar 102 vs 100 tok/s: inside the margin, no reload
    assert kept.threads == (1, 1) and "kept" in kept.why
    assert choose_split(profile, None, (2, 2, False)).source == "default"


def test_auto_loads_the_thread_split_its_cached_profile_predicts_fastest(same_draft, tmp_path, monkeypatch):
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline, pipeline

    opened = []  # the thread split of every set of sessions a load opens (the real sessions, counted)
    real_open = pipeline.open_sessions
    monkeypatch.setattr(pipeline, "open_sessions", lambda *args: opened.append(args[3]) or real_open(*args))

    n = cores()
    plan = DeviceRequest(plan_from_profile=True)
    with Pipeline.load(same_draft, plan) as pipe:  # no profile cached yet: today's default
        assert pipe.threads == (n, n) and pipe.planner.thread_choice.source == "default"
        assert "no cached profile" in pipe.planner.thread_choice.why
    cache_profile(same_draft, [split_costs(n, n, 0.009, 0.004, 2.0), split_costs(1, 1, 0.010, 0.001)], alpha=0.9)
    with Pipeline.load(same_draft, DeviceRequest(target_threads=n, draft_threads=n, plan_from_profile=True)) as pipe:
        assert pipe.threads == (n, n) and pipe.planner.thread_choice.source == "given"  # explicit threads win
    opened.clear()
    with Pipeline.load(same_draft, plan) as pipe:
        assert pipe.threads == (1, 1), pipe.planner.thread_choice
        assert opened == [(1, 1)]  # chosen before any session opened: nothing opened with n + n and closed again
        assert {s.backend.session.get_session_options().intra_op_num_threads for s in pipe.sessions.values()} == {1}
        ar = generate(pipe, "ar")
        auto = generate(pipe, "auto")
        assert auto.tokens == ar.tokens
        threads = auto.stats.auto["threads"]
        assert threads["chosen"] == "1+1" and threads["source"] == "profile" and "mirror" in threads["why"]
        assert set(threads["candidates"]) == {f"{n}+{n}", "1+1"}
        assert auto.stats.to_dict()["auto"]["threads"]["chosen"] == "1+1"  # --json prints it
    cache_profile(same_draft, [split_costs(n, n, 0.009, 0.004, 2.0), split_costs(1, 1, 0.010, 0.001)], alpha=0.0)
    with Pipeline.load(same_draft, plan) as pipe:  # a useless draft: ar, on every core
        assert pipe.threads == (n, n) and pipe.planner.thread_choice.source == "profile"


# ---- leaving ar (runtime/planner/ar_probe.py) -------------------------------------------------------------------
def run_auto(pipe, prior, tokens: int):
    """Decode ``tokens`` with an AutoProposer planning from ``prior`` and probing the draft while in ar."""
    from mirrorsd.runtime.planner.ar_probe import ArProbe

    config = GenerationConfig(max_new_tokens=tokens, chat=False)
    proposer = AutoProposer(lambda s: pipe._proposer(concrete(config, s)), pipe.planner.costs(pipe.thread_key), prior,
                            context=0, new_tokens=tokens, probe=ArProbe(pipe.draft))
    settings = DecodeSettings(tokens, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit,
                              proposer.costs.max_gamma, sampler=GREEDY)
    seen = []
    observe = proposer.observe
    proposer.observe = lambda v, new, g: (seen.append(proposer.strategy.mode), observe(v, new, g))
    try:
        outcome = decode(pipe.target, proposer, pipe.encode(PROMPT, config), settings)
    finally:
        proposer.close()
    reference = pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=tokens, chat=False)).tokens
    return proposer, outcome, reference, seen


def test_leaves_ar_when_the_probe_measures_a_good_draft(same_draft, single_thread):
    """Told that the draft is useless, auto starts in ar; the probe then finds the draft right every time, and with
    costs where speculation pays at that acceptance, auto leaves ar. Output = ar's, before and after."""
    from dataclasses import replace

    from mirrorsd.runtime.planner.ar_probe import PROBE_STEPS

    pipe = single_thread(same_draft)
    measured = with_costs(pipe)
    pessimistic = replace(measured.acceptance, alpha=0.0, reuse=0.0, reuse_noexit=0.0, source="test", stops=())
    proposer, outcome, reference, seen = run_auto(pipe, pessimistic, 96)
    assert outcome.tokens == reference
    assert proposer.first.strategy.mode == "ar"
    # the text repeats, so auto may take ngram first (lookup replay); the probe runs there too (no draft either)
    probed = [s for s in proposer.switches if "ar probe" in s.reason]
    assert probed and probed[0].old.split()[0] in ("ar", "ngram"), proposer.report()
    assert probed[0].new.split()[0] in ("sd", "mirror", "mirror-noexit")
    assert all(s.new.split()[0] == "ngram" for s in proposer.switches[:proposer.switches.index(probed[0])])
    assert set(seen[:PROBE_STEPS]) <= {"ar", "ngram"} and seen[-1] not in ("ar", "ngram")  # left after the 1st probe
    probe = proposer.report()["ar_probe"]
    assert probe["rows"] >= PROBE_STEPS - 1 and probe["alpha"] > 0.9, probe
    assert outcome.counters.accepted > 0


def test_stays_in_ar_when_the_probe_measures_a_useless_draft(random_draft, single_thread):
    from dataclasses import replace

    pipe = single_thread(random_draft)
    measured = with_costs(pipe)
    proposer, outcome, reference, seen = run_auto(pipe, replace(measured.acceptance, alpha=0.0, source="test", stops=()), 96)
    assert outcome.tokens == reference
    # never to the draft; the random text repeats, so the lookup replay may take ngram (no draft either)
    assert set(seen) <= {"ar", "ngram"} and seen[0] == "ar", proposer.report()
    assert all(s.new.split()[0] == "ngram" and "lookup replay" in s.reason for s in proposer.switches)
    probe = proposer.report()["ar_probe"]
    assert probe["probes"] >= 2 and probe["alpha"] < 0.5, probe
    carried = proposer.measured_acceptance()  # what the next generation's prior takes from this one: the probe's
    assert carried.source == "online" and carried.alpha == pytest.approx(probe["alpha"], abs=1e-4)


def test_the_probe_is_not_timed_as_part_of_ar_s_steps(random_draft, single_thread, monkeypatch):
    """A probe's draft forward (the first one a prefill of the whole text) runs inside a step of ar, and is no part
    of ar's cost: timed in, it made ar look slow and auto re-plan away from it. Here each probe takes 0.3 s more:
    ar's measured step time still matches its profile, and nothing re-plans."""
    import time
    from dataclasses import replace

    from mirrorsd.runtime.planner.ar_probe import ArProbe

    slow = ArProbe.probe
    monkeypatch.setattr(ArProbe, "probe", lambda self, committed: (time.sleep(0.3), slow(self, committed))[1])
    pipe = single_thread(random_draft)
    measured = with_costs(pipe)
    proposer, outcome, reference, seen = run_auto(pipe, replace(measured.acceptance, alpha=0.0, source="test", stops=()), 96)
    assert outcome.tokens == reference and proposer.report()["ar_probe"]["probes"] >= 2
    ar = next(s for s in proposer.step_factor if s.mode == "ar")
    assert proposer.step_factor[ar] < 3.0, proposer.step_factor  # 0.3 s in 16 steps of a few ms: factor > 10
    assert not [s for s in proposer.switches if "measured" in s.reason], proposer.report()


def test_the_prior_is_a_running_mean_over_generations():
    """Hand-computed: a calibration over 6 prompts at alpha 0.6, then generations at 0.9 and 0.3: each counts as
    one prompt, so the priors are (6 * 0.6 + 0.9) / 7 and (6 * 0.6 + 0.9 + 0.3) / 8 (the old fixed weight 0.5 gave
    0.75, then 0.525: the last prompt's acceptance, not the pair's)."""
    from mirrorsd.runtime.planner.auto import blend, running_weight
    from mirrorsd.runtime.planner.latency import Acceptance

    prior = Acceptance(0.6, 0.5, 0.5, "calibration")
    after_one = blend(prior, Acceptance(0.9, 0.5, 0.5, "online"), running_weight(1, 6))
    assert after_one.alpha == pytest.approx((6 * 0.6 + 0.9) / 7)
    after_two = blend(after_one, Acceptance(0.3, 0.5, 0.5, "online"), running_weight(2, 6))
    assert after_two.alpha == pytest.approx((6 * 0.6 + 0.9 + 0.3) / 8)
    assert blend(after_two, Acceptance(0.1, 0.1, 0.1, "calibration"), running_weight(3, 6)) == after_two


def test_leave_ar_needs_a_margin():
    """Hysteresis: a speculative strategy predicted 5 % faster than ar does not make auto leave it; 15 % does."""
    from mirrorsd.runtime.planner.ar_probe import LEAVE_MARGIN, leave_ar
    from mirrorsd.runtime.planner.latency import Acceptance, Prediction, Table

    def table(ratio):
        return Table((Prediction(Strategy("sd", 2), 0.01 / ratio, 1.0), Prediction(Strategy("ar"), 0.01, 1.0)),
                     Acceptance(0.5, 0.0))

    assert LEAVE_MARGIN == pytest.approx(0.10)
    assert leave_ar(table(1.05)) is None
    assert leave_ar(table(1.15)).strategy.mode == "sd"
    only_ar = Table((Prediction(Strategy("ar"), 0.01, 1.0),), Acceptance(0.5, 0.0))
    assert leave_ar(only_ar) is None
    # from ngram (the draft idle there too): measured against ngram's own row, and never "leaving" for ngram
    ngram = Strategy("ngram", 3)
    ar = Prediction(Strategy("ar"), 0.01, 1.0)
    rows = (Prediction(ngram, 0.01, 1.2), Prediction(Strategy("sd", 2), 0.01, 1.25), ar)
    assert leave_ar(Table(rows, Acceptance(0.5, 0.0)), current=ngram) is None  # sd 4 % faster than ngram
    rows = (Prediction(Strategy("sd", 2), 0.01, 1.5), Prediction(ngram, 0.01, 1.2), ar)
    assert leave_ar(Table(rows, Acceptance(0.5, 0.0)), current=ngram).strategy.mode == "sd"


def test_no_probe_when_speculation_cannot_pay(same_draft, single_thread):
    """A draft that costs as much as the target never pays, even when always right: auto does not probe it."""
    from dataclasses import replace

    pipe = single_thread(same_draft)
    measured = with_costs(pipe)
    costs = replace(pipe.planner.costs(pipe.thread_key), draft1_s=0.050, branch_fwd_s=0.060)
    pipe.use_profile(replace(pipe.profile(), splits=(costs,), detail=({},)))
    proposer, outcome, reference, _ = run_auto(pipe, replace(measured.acceptance, alpha=0.0, source="test", stops=()), 48)
    assert outcome.tokens == reference
    assert proposer.report()["ar_probe"] is None
    assert all(s.new.split()[0] == "ngram" for s in proposer.switches), proposer.report()  # never to the draft


def test_no_probe_when_too_few_tokens_remain_for_a_switch_to_pay(same_draft, single_thread):
    """The draft's prefill (30 ms per token here) is what a switch costs: at step 32 of 96 (32 tokens of context,
    64 to come) even a perfect draft would not repay it, so auto does not spend a probe (itself a prefill) on it."""
    from dataclasses import replace

    pipe = single_thread(same_draft)
    measured = with_costs(pipe, draft_prefill_s=0.030)
    proposer, outcome, reference, seen = run_auto(pipe, replace(measured.acceptance, alpha=0.0, source="test", stops=()), 96)
    assert outcome.tokens == reference and set(seen) <= {"ar", "ngram"}  # ngram: the lookup replay, no draft
    probe = proposer.report()["ar_probe"]
    assert probe is not None and probe["probes"] == 0, probe  # probing was on, and declined each time


def test_sd_starts_from_a_draft_cache_that_holds_a_prefix_of_its_text(same_draft, single_thread):
    """A switch ar -> sd reuses what the ar probe fed the draft (no second prefill of the text); a cache holding
    another text is emptied."""
    from mirrorsd.runtime.proposers import SerialDraft

    pipe = single_thread(same_draft)
    text = pipe.encode(PROMPT, GenerationConfig(chat=False)) + [5, 6, 7]
    pipe.draft.reset()
    pipe.draft.extend(text[:4])  # as a probe leaves it
    SerialDraft(pipe.draft).reset(text)
    assert pipe.draft.cache_tokens == text[:4] and pipe.draft.cache.length == 4
    SerialDraft(pipe.draft).reset([9] + text)  # another text: nothing of the cache applies
    assert pipe.draft.cache_tokens == [] and pipe.draft.cache.length == 0
    assert generate(pipe, "sd").tokens == generate(pipe, "ar").tokens


# ---- a profile that cannot be trusted ------------------------------------------------------------------------------
@pytest.mark.parametrize("ar_ahead, switches", [(1.02, False), (1.10, True)])
def test_a_replan_leaves_the_running_strategy_only_for_a_clear_gain(ar_ahead, switches):
    """The running sd measured below its prediction; corrected by what it measured, ar is now predicted ``ar_ahead``
    times as fast. Within REPLAN_MARGIN the model cannot tell them apart: auto keeps sd (its prediction now what it
    measured); beyond it, auto switches to ar."""
    from mirrorsd.runtime.planner.auto import REPLAN_MARGIN
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts

    assert 1.02 < 1 + REPLAN_MARGIN < 1.10
    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.0105, 0.011, 0.0115, 0.012),
                       exit_s=(0.0,) * 5, draft1_s=0.002, branch_fwd_s=0.0025, branch_batch=2)
    proposer = AutoProposer(lambda s: None, costs, Acceptance(0.9, 0.9, source="test"), context=10, new_tokens=400)
    running = proposer.strategy
    assert running.mode in ("sd", "mirror")
    predicted, ar = proposer.current.tokens_per_second, proposer.table.best_of("ar").tokens_per_second
    proposer.step_factor[running] = predicted * ar_ahead / ar  # what _correct sets from the measured steps
    measured = ar / ar_ahead
    proposer._replan(measured, predicted)
    if switches:
        assert proposer._pending is not None and proposer._pending.strategy.mode == "ar", proposer.switches
    else:
        assert proposer._pending is None and not proposer.switches
        assert proposer.current.strategy == running
        assert proposer.current.tokens_per_second * proposer.scale == pytest.approx(measured)


def test_measured_step_times_correct_a_profile_wrong_for_speculation(random_draft):
    """A profile whose speculative costs are a hundredth of the real ones (taken while other jobs ran, the way a
    1-row verify measured dearer than a 2-row one): auto starts speculating, measures its steps, corrects the costs
    of every speculative strategy by them and finishes without the draft (ar, whose cost was right, or ngram where
    its measured steps pay on this repeating text); the tokens are ar's."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline

    with Pipeline.load(random_draft, DeviceRequest(target_threads=1, draft_threads=1)) as pipe:
        measured = pipe.profile()  # measured now (other tests fix the costs of their shared pipelines)
        real = measured.split(*pipe.thread_key)
        check_correction(pipe, measured, real)


def check_correction(pipe, measured, real) -> None:
    from dataclasses import replace

    cheap = replace(real, verify_s=(real.verify_s[0], *(v / 100 for v in real.verify_s[1:])),
                    exit_s=tuple(v / 100 for v in real.exit_s), draft1_s=real.draft1_s / 100,
                    branch_fwd_s=real.branch_fwd_s / 100, stream_window_s=(), draft_prefill_s=0.0,
                    mirror_host_s=(), prefix_s=())
    pipe.use_profile(replace(measured, splits=(cheap,), detail=({},)))
    result = pipe.generate(PROMPT, GenerationConfig(max_new_tokens=96, chat=False))
    auto = result.stats.auto
    assert not auto["chosen"].startswith("ar"), auto  # the wrong profile predicts speculation far faster
    assert auto["final"].split()[0] in ("ar", "ngram"), auto  # off the draft (ngram: the random text repeats)
    assert result.tokens == pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=96, chat=False)).tokens


def test_a_cached_profile_that_contradicts_itself_is_measured_again(random_draft):
    """A cached split whose 1-row verify costs ten times its 2-row one (measured on a busy machine) is measured
    again when the pipeline asks for its profile, not trusted."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner.profiling import contradiction

    busy = split_costs(1, 1, verify=0.002, draft1=0.001)
    busy = type(busy)(**{**busy.__dict__, "verify_s": (0.020, *busy.verify_s[1:])})
    assert contradiction(busy)
    cache_profile(random_draft, [busy], alpha=0.5)
    with Pipeline.load(random_draft, DeviceRequest(target_threads=1, draft_threads=1)) as pipe:
        costs = pipe.profile().split(1, 1)
    assert costs.verify_s[0] != 0.020 and costs.verify_s[1:] != busy.verify_s[1:], costs


def test_tempered_alpha_accepts_the_given_fraction_of_the_tokens():
    """Plain sd's alpha, tempered by the shortfall a stop measured: a window of the same gamma accepts that
    fraction of the tokens it did; factor 1 (or more) leaves it."""
    from mirrorsd.runtime.planner.auto import tempered_alpha
    from mirrorsd.runtime.planner.latency import expected_tokens

    for alpha, factor, gamma in ((0.82, 0.6, 6), (0.5, 0.25, 4), (0.9, 0.9, 1)):
        tempered = tempered_alpha(alpha, factor, gamma)
        assert tempered < alpha
        assert expected_tokens(tempered, gamma) - 1 == pytest.approx(factor * (expected_tokens(alpha, gamma) - 1),
                                                                     abs=1e-6)
    assert tempered_alpha(0.7, 1.0, 4) == 0.7 and tempered_alpha(0.7, 1.5, 4) == 0.7


def test_auto_tempers_what_it_cannot_measure_by_what_its_stop_measured():
    """Running sd with a stop at 0.8 on text the draft knows less well than the calibration: the stop at 0.5
    (which those windows cannot replay) and plain sd's alpha are scaled down by the same shortfall, so the
    stops auto has not run no longer look faster only because they are still the calibration's."""
    from mirrorsd.runtime.planner.latency import Acceptance, expected_tokens
    from mirrorsd.runtime.planner.stops import StopCounts, stop_at

    prior_stops = tuple(StopCounts(g, t, 100 + 200, (0,) * g + (100,)) for g in range(1, 7)
                        for t in (0.5, 0.7, 0.8, 0.9))  # 2 accepted per step everywhere
    prior = Acceptance(0.82, 0.3, source="calibration", stops=prior_stops)
    proposer = AutoProposer(lambda s: None, split_costs(2, 2, 0.06, 0.02), prior, max_gamma=6)
    for _ in range(20):  # windows at (6, 0.8): the draft's second pick falls below 0.8; the target accepts 1 of 2
        proposer.stops.record([0.95, 0.6], 1, 6, 0.8)
    acceptance = proposer.acceptance()
    measured = stop_at(acceptance.stops, 6, 0.8)
    assert measured.tokens == 40 and measured.steps == 20  # this text's own counts: 1 accepted per step
    unmeasured = stop_at(acceptance.stops, 6, 0.5)
    assert unmeasured.lengths == (0,) * 6 + (100,) and unmeasured.tokens == 100 + 100  # 2 -> 1 per step, as 0.8's
    assert acceptance.alpha < 0.82
    gamma = max(proposer.strategy.gamma, 1)
    assert expected_tokens(acceptance.alpha, gamma) - 1 == pytest.approx(0.5 * (expected_tokens(0.82, gamma) - 1),
                                                                         abs=1e-6)
