"""Prompt lookup (runtime/ngram.py): the matcher on hand-made texts; mode ngram and sd --ngram emit exactly ar's
token ids (greedy, and at T > 0 the same draws with the exact rule); the residual rule with copied windows passes
the distribution test; sd --ngram drafts the same windows as sd in fewer draft forwards."""
from __future__ import annotations

import numpy as np
import pytest

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.ngram import NgramIndex, NgramProposer, NgramSettings
from mirrorsd.runtime.sampling import Sampler, SamplingParams

from mirrorsd.runtime import sampling

from test_sampling import ALPHA, DIST, RUNS, accept_every_draft_token, gof_pvalue, reference_distribution
from test_speculative import PROMPTS, check_invariants

NEW = 40


def index_of(tokens, min_n=2, max_n=4) -> NgramIndex:
    index = NgramIndex(NgramSettings(min_n, max_n))
    index.extend(tokens)
    return index


# ---- the matcher ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,count,expected", [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # (1, 2) was followed by 3
    ([1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 2, [7, 2]),  # (1, 2, 3) beats the more recent (2, 3) -> 8: longest first
    ([5, 2, 3, 7, 6, 2, 3, 8, 2, 3], 2, [8, 2]),  # same length: the most recent occurrence wins
    ([4, 5, 6, 4, 5, 6], 7, [4, 5, 6, 4, 5, 6, 4]),  # a run into the suffix repeats with the match's period
    ([7, 7, 7], 3, [7, 7, 7]),
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([1, 9, 2, 1], 2, []),  # a 1-gram is below min_n
    ([1, 2], 2, []),  # the suffix never matches itself
    ([1, 2, 3, 1, 2], 0, []),
])
def test_lookup_hand_made(text, count, expected):
    assert index_of(text).lookup(count) == expected


def test_min_and_max_n():
    assert index_of([1, 9, 2, 1], min_n=1).lookup(2) == [9, 2]
    text = [1, 2, 3, 4, 5, 9, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5]
    assert index_of(text, max_n=5).lookup(1) == [9]  # (1 .. 5) continued with 9
    assert index_of(text, max_n=4).lookup(1) == [8]  # (2 .. 5) most recently continued with 8


def test_sync_appends_and_reindexes_another_text():
    index = index_of([1, 2, 3])
    index.sync([1, 2, 3, 1, 2])
    assert index.tokens == [1, 2, 3, 1, 2] and index.lookup(1) == [3]
    index.sync([4, 5, 4])  # not a continuation: indexed afresh, nothing of [1, 2, 3] left
    assert index.tokens == [4, 5, 4] and index.lookup(1) == []
    index.sync([4, 5, 4, 5])
    assert index.lookup(3) == [4, 5, 4]


def test_incremental_equals_whole():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 6, 300).tolist()  # a small alphabet: many repeats
    grown = NgramIndex()
    for end in range(1, len(text) + 1):
        grown.sync(text[:end])
        assert grown.lookup(4) == index_of(text[:end]).lookup(4)
        if end > 5:
            whole = _brute_force(text[:end], 4)
            assert grown.lookup(4) == whole


def _brute_force(text, count, min_n=2, max_n=4):
    for n in range(max_n, min_n - 1, -1):
        if n > len(text):
            continue
        suffix = text[-n:]
        for start in range(len(text) - 1, n - 1, -1):  # latest continuation start first, the suffix itself excluded
            if text[start - n:start] == suffix and start < len(text):
                period = text[start:]
                return [period[i % len(period)] for i in range(count)]
    return []


def test_proposer_windows_and_one_hot_q():
    proposer = NgramProposer(vocab_size=10)
    residual = Sampler(SamplingParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                                      seed=1, verify="residual"))
    proposer.reset([1, 2, 3, 1], residual)
    assert proposer.propose([1, 2, 3, 1], 3).tokens.size == 0  # (3, 1) and (1) alone: no match
    window = proposer.propose([1, 2, 3, 1, 2], 3)
    assert window.tokens.tolist() == [3, 1, 2] and window.forwards == 0
    assert window.probs.shape == (3, 10) and (window.probs.argmax(1) == window.tokens).all()
    assert window.probs.sum() == 3.0
    assert (proposer.looked_up, proposer.matched) == (2, 1)


# ---- decoding: exact ------------------------------------------------------------------------------------------
REPEATS = [[1, 17, 42, 99, 7, 1, 17, 42, 99], [3, 4, 5, 3, 4, 5, 3, 4]]


def memoryless_pipeline(folder, draft_layers):
    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.runtime import Pipeline
    from tiny_models import build_model

    export(ExportOptions(model=build_model(folder / "hf", memoryless=True), output=folder / "out",
                         draft_layers=draft_layers))
    return Pipeline.load(folder / "out")


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    """A memoryless tiny llama (tiny_models.build_model): its greedy text runs into a cycle within a few dozen
    tokens, so lookups match; a random model's text hardly ever repeats. The draft is its first 2 layers."""
    with memoryless_pipeline(tmp_path_factory.mktemp("ngram"), 2) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def same_pipe(tmp_path_factory):
    """The memoryless model with a draft equal to it (every window the text's own continuation)."""
    with memoryless_pipeline(tmp_path_factory.mktemp("ngram-same"), 4) as loaded:
        yield loaded


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_ngram_mode_equals_ar(gamma, pipe):
    matched = accepted = 0
    for prompt in PROMPTS + REPEATS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        out = pipe.generate(prompt, GenerationConfig(mode="ngram", max_new_tokens=NEW, gamma=gamma))
        assert out.tokens == ar.tokens, (gamma, prompt)
        check_invariants(out.stats, "ngram")
        assert out.stats.draft_forwards == 0 and out.stats.fallbacks == out.stats.windows
        assert out.stats.drafted <= gamma * out.stats.windows
        matched, accepted = matched + out.stats.windows, accepted + out.stats.accepted
    assert matched > 0 and accepted > 0  # the test saw copied windows, and some of their tokens accepted


def test_ngram_mode_with_wrong_copies(pipe):
    """A prompt that holds the text's next bigram followed by the wrong tokens: the copied window is rejected, and
    the tokens are still ar's."""
    first, second = pipe.generate([9, 8], GenerationConfig(mode="ar", max_new_tokens=2)).tokens
    wrong = next(t for t in range(3, 50) if t != second)
    prompt = [8, first, wrong, wrong + 1, 9, 8]  # after `first` the lookup proposes wrong, wrong + 1, 9, ...
    ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=12))
    out = pipe.generate(prompt, GenerationConfig(mode="ngram", max_new_tokens=12, gamma=4))
    assert out.tokens == ar.tokens and ar.tokens[:2] == [first, second]
    assert out.stats.windows >= 1 and out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("streaming", [True, False])
def test_sd_with_lookup_drafts_the_same_windows_in_fewer_forwards(streaming, pipe):
    fewer = False
    for prompt in PROMPTS + REPEATS:
        base = GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=4, streaming=streaming)
        sd = pipe.generate(prompt, base)
        looked = pipe.generate(prompt, GenerationConfig(**{**base.__dict__, "ngram": True}))
        assert looked.tokens == sd.tokens
        # the same windows: the same drafted and accepted tokens, step by step
        assert (looked.stats.steps, looked.stats.drafted, looked.stats.accepted) == \
            (sd.stats.steps, sd.stats.drafted, sd.stats.accepted)
        assert looked.stats.draft_forwards <= sd.stats.draft_forwards
        fewer |= looked.stats.draft_forwards < sd.stats.draft_forwards
    assert fewer, "some guess must have saved a draft forward"


@pytest.mark.parametrize("kind", ["truncated", "same"])
def test_mirror_with_lookup_drafts_the_same_windows(kind, pipe, same_pipe):
    """Mirror's fresh windows (the first one, and misses) take the lookup's guess as lookahead; with the cap budget
    (every branch rolled out before the verdict, deterministic) the windows are the same as without it, the
    forwards no more. A miss is where the draft left the target's text, so the guesses save forwards where the draft
    follows the text (the same draft), hardly ever after a miss of the truncated one."""
    pipe = same_pipe if kind == "same" else pipe
    fewer = False
    for prompt in PROMPTS + REPEATS:
        base = GenerationConfig(mode="mirror", max_new_tokens=NEW, gamma=4, branch_budget="cap", branches=2)
        plain = pipe.generate(prompt, base)
        looked = pipe.generate(prompt, GenerationConfig(**{**base.__dict__, "ngram": True}))
        assert looked.tokens == plain.tokens
        assert (looked.stats.steps, looked.stats.drafted, looked.stats.accepted, looked.stats.reused) == \
            (plain.stats.steps, plain.stats.drafted, plain.stats.accepted, plain.stats.reused)
        assert looked.stats.draft_forwards <= plain.stats.draft_forwards
        fewer |= looked.stats.draft_forwards < plain.stats.draft_forwards
        time_budget = pipe.generate(prompt, GenerationConfig(**{**base.__dict__, "ngram": True,
                                                                "branch_budget": "time"}))
        assert time_budget.tokens == plain.tokens
    if kind == "same":
        assert fewer, "some guess must have saved a draft forward"


def test_identical_draft_with_lookup(exported, pipelines):
    pipe = pipelines(exported("llama", draft_layers=4))  # a draft equal to the target: every window accepted
    for prompt in PROMPTS + REPEATS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, GenerationConfig(mode=mode, ngram=True, max_new_tokens=NEW, gamma=3))
            assert out.tokens == ar.tokens and out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("kw", [dict(ngram_min=0), dict(ngram_min=3, ngram_max=2), dict(ngram_max=17),
                                dict(ngram_max=2.5)])
def test_bad_ngram_settings(kw, pipe):
    with pytest.raises(GenerationInputError):
        pipe.generate([1, 2, 3], GenerationConfig(mode="ngram", **kw))


# ---- decoding: sampling ---------------------------------------------------------------------------------------
def sampled(mode, verify, seed, **kw):
    return GenerationConfig(**{**dict(mode=mode, verify=verify, max_new_tokens=4, gamma=2, seed=seed), **DIST, **kw})


@pytest.mark.parametrize("mode,extra", [("ngram", {}), ("sd", {"ngram": True})])
def test_exact_rule_same_draws_as_ar(mode, extra, pipe):
    for prompt in REPEATS:
        for seed in range(3):
            ar = pipe.generate(prompt, sampled("ar", "exact", seed, max_new_tokens=24)).tokens
            out = pipe.generate(prompt, sampled(mode, "exact", seed, max_new_tokens=24, **extra))
            assert out.tokens == ar, (mode, seed)  # every committed token is the target's draw at its position


def likely_copy_prompt(pipe) -> list[int]:
    """A prompt after which the lookup proposes a likely window whatever the first sampled token y is: it ends with
    a token a, and holds (a, y, c) for each of a's likeliest successors y, with c the target's pick after y (the
    fixture is memoryless, so that pick holds wherever y stands). Rejections happen too: DIST flattens q."""

    def last_logits(ids):
        pipe.target.reset(1, len(ids) + 1)
        return pipe.target.extend(ids)[-1]

    a = 7
    segments = []
    for y in np.argsort(last_logits([1, a]))[::-1][:8].tolist():
        segments += [a, y, int(np.argmax(last_logits([1, a, y])))]
    return [1, *segments, a]


def copied_window_samples(pipe, prompt, seeds):
    samples, accepted, drafted = [], 0, 0
    for seed in seeds:
        result = pipe.generate(prompt, sampled("ngram", "residual", seed))
        tokens = result.tokens[:3]
        samples.append(tuple(tokens) + (-1,) * (3 - len(tokens)))
        accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
    return samples, accepted, drafted


@pytest.fixture(scope="module")
def copy_case(pipe):
    prompt = likely_copy_prompt(pipe)
    return prompt, reference_distribution(pipe, SamplingParams(**DIST), prompt=prompt)


def test_residual_rule_with_copied_windows_matches_target_sampling(pipe, copy_case):
    prompt, reference = copy_case
    samples, accepted, drafted = copied_window_samples(pipe, prompt, range(700_000, 700_000 + RUNS))
    p = gof_pvalue(samples, reference)
    assert p > ALPHA, f"ngram/residual: p = {p:.2e}"
    assert 0 < accepted < drafted, "the test must see copied tokens accepted and rejected"


@pytest.mark.parametrize("wrong", [accept_every_draft_token])
def test_the_copy_case_rejects_a_wrong_rule(wrong, pipe, copy_case, monkeypatch):
    """Power. (test_sampling's other wrong rule, resampling from p without the rejected token, is no wrong rule
    here: with a one-hot q the residual max(0, p - q) is exactly that.)"""
    prompt, reference = copy_case
    monkeypatch.setitem(sampling.RULES, "residual", wrong)
    samples = copied_window_samples(pipe, prompt, range(800_000, 800_000 + RUNS))[0]
    p = gof_pvalue(samples, reference)
    assert p < ALPHA, f"{wrong.__name__} passed the distribution test with copied windows: p = {p:.2e}"


# ---- the planner: replay, latency model, auto ----------------------------------------------------------------
def simulate_ngram_mode(text, start, gamma):
    """Mode ngram's steps on a known text, written plainly: (tokens committed, steps by verified rows)."""
    widths, tokens, at = [0] * (gamma + 1), 0, start
    while True:
        proposal = index_of(text[:at]).lookup(gamma)
        if at + len(proposal) >= len(text):
            return tokens, tuple(widths)  # the text does not decide this step yet
        matched = 0
        while matched < len(proposal) and proposal[matched] == text[at + matched]:
            matched += 1
        widths[len(proposal)] += 1
        tokens += matched + 1
        at += matched + 1


@pytest.mark.parametrize("seed", range(6))
def test_replay_equals_a_plain_simulation(seed):
    from mirrorsd.runtime.planner.lookup import LookupReplay

    rng = np.random.default_rng(seed)
    text = rng.integers(0, 5 + seed, 160).tolist()
    prompt = 12
    replay = LookupReplay(6)
    replay.start(text[:prompt], text[prompt])
    end = prompt + 1
    while end < len(text):  # the committed text grows by steps of 1 .. 5 tokens
        end = min(len(text), end + int(rng.integers(1, 6)))
        replay.follow(text[:end])
    for g in range(1, 7):
        counts = replay.counts(g)
        assert (counts.tokens, counts.widths) == simulate_ngram_mode(text, prompt + 1, g), g
        assert counts.windows == counts.steps - counts.widths[0]


def test_latency_ranks_ngram_from_its_replay():
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, Strategy, predict, rank
    from mirrorsd.runtime.planner.lookup import LookupCounts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.011, 0.012, 0.013), exit_s=(0.0,) * 4,
                       draft1_s=0.005, branch_fwd_s=0.006, branch_batch=2)
    # at g = 2: 10 steps, 4 of one row, 6 verifying a 2-token window (3 rows), committing 22 tokens
    lookup = (LookupCounts(9, (7, 1)), LookupCounts(22, (4, 0, 6)), LookupCounts(3, (1, 0, 0, 1)))
    acceptance = Acceptance(0.0, 0.0, source="test", lookup=lookup)
    row = predict(costs, Strategy("ngram", 2), acceptance)
    assert row.tokens_per_step == pytest.approx(2.2)
    assert row.step_s == pytest.approx((4 * 0.010 + 6 * 0.012) / 10)
    table = rank([costs], acceptance)
    assert table.best.strategy.mode == "ngram" and table.best.strategy.gamma == 2
    assert {r.strategy.gamma for r in table.rows if r.strategy.mode == "ngram"} == {1, 2}  # g = 3: 2 steps, < 8
    assert all(r.strategy.mode != "ngram" for r in rank([costs], Acceptance(0.0, 0.0)).rows)


def test_measured_factors_reach_untried_strategies_with_the_same_parts():
    """A measured sd step (its draft slower than profiled) makes every untried sd and mirror strategy dearer, not
    ngram, whose step has no draft; a measured ar or ngram step makes an untried ngram dearer."""
    from mirrorsd.runtime.planner.auto import corrected
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, Strategy, rank
    from mirrorsd.runtime.planner.lookup import LookupCounts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.011, 0.012, 0.013), exit_s=(0.0,) * 4,
                       draft1_s=0.005, branch_fwd_s=0.006, branch_batch=2)
    lookup = (LookupCounts(12, (8, 2)), LookupCounts(14, (8, 0, 2)), LookupCounts(16, (8, 0, 0, 2)))
    table = rank([costs], Acceptance(0.6, 0.3, source="test", lookup=lookup))
    step = {r.strategy: r.step_s for r in table.rows}
    sd2, sd3, ngram2 = (Strategy(m, g, split=costs.split) for m, g in (("sd", 2), ("sd", 3), ("ngram", 2)))
    ar = Strategy("ar", split=costs.split)
    fixed = {r.strategy: r.step_s for r in corrected(table, {sd2: 1.5}).rows}
    assert fixed[sd2] == pytest.approx(1.5 * step[sd2]) and fixed[sd3] == pytest.approx(1.5 * step[sd3])
    assert all(fixed[s] == pytest.approx(1.5 * step[s]) for s in step if s.mode == "mirror")
    assert fixed[ngram2] == pytest.approx(step[ngram2]) and fixed[ar] == pytest.approx(step[ar])
    fixed = {r.strategy: r.step_s for r in corrected(table, {sd2: 1.5, ar: 1.2}).rows}
    assert fixed[ngram2] == pytest.approx(1.2 * step[ngram2]) and fixed[sd3] == pytest.approx(1.5 * step[sd3])
    fixed = {r.strategy: r.step_s for r in corrected(table, {ngram2: 1.3}).rows}
    ngram1 = Strategy("ngram", 1, split=costs.split)
    assert fixed[ngram1] == pytest.approx(1.3 * step[ngram1])
    assert fixed[sd3] == pytest.approx(1.3 * step[sd3])  # a slow multi-row verify is slow for sd too
    assert fixed[ar] == pytest.approx(step[ar])


def test_auto_switches_to_ngram_when_its_replay_pays(pipe):
    """Auto told the draft is useless starts (and would stay) in ar; the text runs into a cycle, the replay
    finds that copied windows pay where a window costs what a row costs, and auto switches to ngram. Output = ar's."""

    from mirrorsd.runtime.decoder import DecodeSettings, decode
    from mirrorsd.runtime.planner.auto import AutoProposer
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts
    from mirrorsd.runtime.planner.planner import concrete

    costs = SplitCosts(target_threads=pipe.threads[0], draft_threads=pipe.threads[1], verify_s=(0.010,) * 7,
                       exit_s=(0.001,) * 7, draft1_s=0.005, branch_fwd_s=0.006, branch_batch=2)
    config = GenerationConfig(max_new_tokens=120)
    proposer = AutoProposer(lambda s: pipe._proposer(concrete(config, s)), costs,
                            Acceptance(0.0, 0.0, source="test"), context=0, new_tokens=120)
    prompt = [1, 17, 42, 99, 7]
    settings = DecodeSettings(120, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit, costs.max_gamma)
    try:
        outcome = decode(pipe.target, proposer, prompt, settings)
    finally:
        proposer.close()
    ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=120))
    assert outcome.tokens == ar.tokens
    assert proposer.first.strategy.mode == "ar"
    assert [s.new.split()[0] for s in proposer.switches][:1] == ["ngram"], proposer.report()
    assert "lookup replay" in proposer.switches[0].reason
    assert outcome.counters.accepted > 0  # copied windows were verified and accepted



def test_leaving_a_draft_for_ngram_counts_only_the_recent_replay():
    """An answer that opened by copying its prompt: the whole replay says ngram pays, the replay since the last
    check says it no longer does. From ar (no draft to give up) the whole replay decides and auto takes ngram; from
    a drafting strategy whose draft is accepted, only the recent replay counts and auto stays; a recent replay that
    still copies takes ngram from there too."""
    from mirrorsd.runtime.planner.auto import AutoProposer
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts
    from mirrorsd.runtime.planner.lookup import LookupCounts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.0105, 0.011, 0.0115, 0.012),
                       exit_s=(0.0,) * 5, draft1_s=0.002, branch_fwd_s=0.0025, branch_batch=2)
    copying = tuple(LookupCounts(1 + 4 * 20, (1, 0, 0, 0, 20)[:g + 1]) if g == 4 else LookupCounts(21, (21,) +
                    (0,) * g) for g in range(1, 5))  # g = 4: 20 windows of 4 copied tokens, + 1 one-row step
    fresh = tuple(LookupCounts(20, (20,) + (0,) * g) for g in range(1, 5))  # nothing copied: one row per step

    def auto(alpha: float, whole: tuple) -> AutoProposer:
        proposer = AutoProposer(lambda s: None, costs, Acceptance(alpha, alpha, source="test"), context=10,
                                new_tokens=400)
        proposer.replay.all_counts = lambda: whole  # the replay's counts over the whole text so far
        return proposer

    from_ar = auto(0.0, copying)
    assert from_ar.strategy.mode == "ar"
    from_ar._take_lookup(20.0, fresh)
    assert from_ar._pending is not None and from_ar._pending.strategy.mode == "ngram"
    from_sd = auto(0.9, copying)
    assert from_sd.strategy.mode in ("sd", "mirror")  # a strategy that runs the draft
    from_sd._take_lookup(20.0, fresh)
    assert from_sd._pending is None and not from_sd.switches
    from_sd._take_lookup(20.0, ())  # the first check: nothing replayed since an earlier one, only the opening
    assert from_sd._pending is None
    from_sd._take_lookup(20.0, copying)
    assert from_sd._pending is not None and from_sd._pending.strategy.mode == "ngram"


def test_a_replan_from_a_draft_counts_only_the_recent_replay():
    """The running sd measured below its prediction and auto ranks again: as when it checks for lookup, the
    answer's opening (the whole replay) does not take it to ngram; only a replay since the previous check that
    still copies does. From ar the whole replay counts."""
    from mirrorsd.runtime.planner.auto import AutoProposer
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts
    from mirrorsd.runtime.planner.lookup import LookupCounts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.0105, 0.011, 0.0115, 0.012),
                       exit_s=(0.0,) * 5, draft1_s=0.002, branch_fwd_s=0.0025, branch_batch=2)
    copying = tuple(LookupCounts(1 + 4 * 20, (1, 0, 0, 0, 20)[:g + 1]) if g == 4 else LookupCounts(21, (21,) +
                    (0,) * g) for g in range(1, 5))
    fresh = tuple(LookupCounts(20, (20,) + (0,) * g) for g in range(1, 5))

    def auto(alpha: float) -> AutoProposer:
        proposer = AutoProposer(lambda s: None, costs, Acceptance(alpha, alpha, source="test"), context=10,
                                new_tokens=400)
        proposer.replay.all_counts = lambda: copying  # the whole text so far: an opening that copied its prompt
        return proposer

    for recent in ((), fresh):
        from_sd = auto(0.9)
        assert from_sd.strategy.mode in ("sd", "mirror")
        from_sd._replan(1.0, 10 * from_sd.current.tokens_per_second, recent)
        assert from_sd._pending is None or from_sd._pending.strategy.mode != "ngram", from_sd.switches
    from_sd = auto(0.9)
    from_sd._replan(1.0, 10 * from_sd.current.tokens_per_second, copying)
    assert from_sd._pending is not None and from_sd._pending.strategy.mode == "ngram"
    from_ar = auto(0.0)
    assert from_ar.strategy.mode == "ar"
    from_ar._replan(1.0, 10 * from_ar.current.tokens_per_second, ())
    assert from_ar._pending is not None and from_ar._pending.strategy.mode == "ngram"


def test_lookup_counts_since_an_earlier_count():
    from mirrorsd.runtime.planner.lookup import LookupCounts

    later, earlier = LookupCounts(30, (10, 2, 5)), LookupCounts(12, (6, 1, 1))
    assert later.since(earlier) == LookupCounts(18, (4, 1, 4))
    assert later.since(None) == later


def test_bench_report_has_lookup_rates_per_category():
    from types import SimpleNamespace

    from mirrorsd.apps.bench_report import _lookup_lines

    def run(category, mode, steps, windows, drafted, accepted):
        stats = dict(steps=steps, windows=windows, drafted=drafted, accepted=accepted)
        return SimpleNamespace(category=category, mode=mode, stats=stats)

    result = SimpleNamespace(runs=[run("coding", "ngram", 10, 4, 12, 6), run("qa", "ngram", 20, 0, 0, 0),
                                   run("coding", "ar", 30, 0, 0, 0)])
    lines = _lookup_lines(result, ["coding", "qa"])
    assert "| coding | 10 | 0.40 | 0.50 | 1.60 |" in lines
    assert "| qa | 20 | 0.00 | 0.00 | 1.00 |" in lines
    assert "| all | 30 | 0.13 | 0.50 | 1.20 |" in lines
    assert _lookup_lines(SimpleNamespace(runs=[run("qa", "ar", 5, 0, 0, 0)]), ["qa"]) == []


def test_auto_runs_sd_and_mirror_with_the_lookahead_unless_told_not_to():
    from mirrorsd.runtime.planner.latency import Strategy
    from mirrorsd.runtime.planner.planner import concrete

    for mode in ("sd", "mirror"):
        assert concrete(GenerationConfig(), Strategy(mode, 2)).ngram is True
        assert concrete(GenerationConfig(ngram=False), Strategy(mode, 2)).ngram is False
    assert GenerationConfig(mode="sd").ngram is None  # fixed sd and mirror: off unless asked for
