"""Mode auto on tiny models: it measures a profile, picks ar for a useless draft and a speculative mode for a
perfect one, stays exact, and keeps token parity with ar when it switches modes in the middle of a generation."""
from __future__ import annotations

import pytest

from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.auto import AutoProposer
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.latency import Strategy
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

    from mirrorsd.profile import Profile
    from mirrorsd.runtime.latency import SplitCosts

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
              Strategy("sd", 5), Strategy("mirror", 6), Strategy("ar"), Strategy("sd", 1)] * 2
    profile = pipe.profile()
    proposer = Scripted(lambda s: pipe._proposer(pipe.concrete(config, s)), pipe._profile_costs(),
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
    re-plans with the acceptance it measured: ar."""
    from dataclasses import replace

    pipe = pipelines(random_draft)
    config = GenerationConfig(max_new_tokens=80, chat=False)
    with_costs(pipe)  # fixed costs: with measured ones a loaded machine could make even a perfect draft lose
    profile = pipe.profile()
    optimistic = replace(profile.acceptance, alpha=0.99, reuse=0.99, reuse_noexit=0.99, source="test")
    proposer = AutoProposer(lambda s: pipe._proposer(pipe.concrete(config, s)), pipe._profile_costs(), optimistic)
    assert proposer.strategy.mode != "ar"
    settings = DecodeSettings(80, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit,
                              proposer.costs.max_gamma, sampler=GREEDY)
    try:
        outcome = decode(pipe.target, proposer, pipe.encode(PROMPT, config), settings)
    finally:
        proposer.close()
    assert outcome.tokens == pipe.generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=80, chat=False)).tokens
    assert proposer.switches, "no re-plan"
    assert proposer.strategy.mode == "ar", proposer.report()
    assert proposer.report()["switches"][0]["new"].startswith("ar")
