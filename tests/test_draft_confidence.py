"""The draft-confidence stop (GenerationConfig.draft_confidence, runtime/rollout.py): a fresh sd window ends after
its first pick the draft gives less than the threshold. Its tokens are a prefix of the window the draft would roll
out without the stop, its probabilities are the draft's own, and sd with any threshold emits exactly ar's tokens
(greedy; at T > 0 the exact rule's same draws, and the residual rule passes the distribution test)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.rollout import fresh
from mirrorsd.runtime.verify import top1_probability

from test_sampling import ALPHA, DIST, RUNS, PROMPT, gof_pvalue, reference_distribution
from test_speculative import PROMPTS, check_invariants
from mirrorsd.runtime.sampling import SamplingParams

NEW = 40


def test_top1_probability_by_hand():
    rows = [[0.0, 0.0], [math.log(3.0), 0.0, 0.0], [5.0, -1e30, -1e30], [1.0, 2.0, 3.0, 4.0]]
    expected = [0.5, 0.6, 1.0, math.exp(4) / sum(math.exp(v) for v in (1, 2, 3, 4))]
    for row, want in zip(rows, expected):
        got = top1_probability(np.array([row], np.float32))
        assert got.shape == (1,) and got[0] == pytest.approx(want, rel=1e-6)
    both = top1_probability(np.array([[0.0, 0.0, 0.0], [9.0, 0.0, 0.0]], np.float32))  # [2]: one per row
    assert both[0] == pytest.approx(1 / 3) and both[1] > 0.99


@pytest.fixture(scope="module")
def pipe(exported, pipelines):
    """A target with a 2-layer truncated draft: its picks are sure at some positions and unsure at others."""
    return pipelines(exported("llama", draft_layers=2))


def thresholds(pipe) -> tuple[float, float, float]:
    """Low, middle and high quantiles of the draft's top-1 probability along a 4-token window on each prompt, so
    that the stop ends some windows early and leaves others whole."""
    seen = []
    for prompt in PROMPTS:
        pipe.draft.reset()  # fresh() expects the committed text to grow between calls: a new text, a new cache
        seen += fresh(pipe.draft, list(prompt), 4, confidence=0.0).confidence.tolist()
    return tuple(float(np.quantile(seen, q)) for q in (0.2, 0.5, 0.8))


def test_window_is_the_plain_windows_prefix_up_to_its_first_unsure_pick(pipe):
    """Hand-checked against the unstopped window: every pick before the last is at or above the threshold, the last
    (unless the window is whole) below it, the tokens a prefix of the plain window's, and the draft's cache holds
    committed + window[:-1] as after any fresh window."""
    stopped = whole = 0
    for threshold in thresholds(pipe):
        for prompt in PROMPTS:
            committed = list(prompt)
            pipe.draft.reset()
            plain = fresh(pipe.draft, committed, 6, confidence=0.0)
            window = fresh(pipe.draft, committed, 6, confidence=threshold)
            g = len(window.tokens)
            assert 1 <= g <= 6 and window.forwards == g
            assert window.tokens.tolist() == plain.tokens[:g].tolist()
            np.testing.assert_allclose(window.confidence, plain.confidence[:g], rtol=1e-5)
            assert all(p >= threshold for p in window.confidence[:-1])
            if g < 6:
                assert window.confidence[-1] < threshold
                stopped += 1
            else:
                whole += 1
            assert pipe.draft.cache.length == len(committed) + g - 1
            assert pipe.draft.cache_tokens == committed + window.tokens[:-1].tolist()
    assert stopped and whole, "the thresholds must end some windows early and leave others whole"


def test_no_threshold_records_nothing_and_zero_never_stops(pipe):
    pipe.draft.reset()
    plain = fresh(pipe.draft, PROMPTS[0], 5)
    assert plain.confidence is None
    recorded = fresh(pipe.draft, PROMPTS[0], 5, confidence=0.0)
    assert len(recorded.tokens) == 5 and recorded.tokens.tolist() == plain.tokens.tolist()
    assert ((recorded.confidence > 0) & (recorded.confidence <= 1.0 + 1e-6)).all()


@pytest.mark.parametrize("kind", ["identical", "random", "truncated"])
@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_sd_with_a_confidence_stop_equals_ar(kind, gamma, exported, tiny_model, pipelines):
    folder = {"identical": lambda: exported("llama", draft_layers=4),
              "random": lambda: exported("llama", draft=tiny_model("llama", layers=2, seed=7)),
              "truncated": lambda: exported("llama", draft_layers=2)}[kind]()
    pipe = pipelines(folder)
    shorter = False
    for threshold in (0.05, *thresholds(pipe), 0.99):
        for prompt in PROMPTS:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
            out = pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma,
                                                         draft_confidence=threshold))
            assert out.tokens == ar.tokens, (kind, gamma, threshold, prompt)
            check_invariants(out.stats, "sd")
            assert out.stats.drafted <= gamma * out.stats.windows
            shorter |= out.stats.drafted < gamma * out.stats.windows
            if kind == "identical":
                assert out.stats.acceptance_rate == 1.0
    if gamma > 1:
        assert shorter, "some window must have ended early"


@pytest.mark.parametrize("ngram", [False, True])
def test_confidence_stop_with_lookahead_equals_ar(ngram, pipe):
    """With a prompt-lookup guess as lookahead a forward may confirm several picks: the window still ends at its
    first unsure one."""
    for prompt in PROMPTS + [[7, 8, 9, 7, 8, 9, 7, 8]]:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        out = pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=5, ngram=ngram,
                                                     draft_confidence=thresholds(pipe)[1]))
        assert out.tokens == ar.tokens


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, float("nan"), True, "0.4"])
def test_bad_thresholds_are_refused(value, pipe):
    with pytest.raises(GenerationInputError, match="draft_confidence"):
        pipe.generate([1, 2, 3], GenerationConfig(mode="sd", draft_confidence=value))


# ---- sampling --------------------------------------------------------------------------------------------------
def sampled(verify, seed, threshold, **kw):
    return GenerationConfig(**{**dict(mode="sd", verify=verify, max_new_tokens=4, gamma=3, seed=seed,
                                      draft_confidence=threshold), **DIST, **kw})


def test_exact_rule_same_draws_as_ar(pipe):
    threshold = thresholds(pipe)[1]
    for prompt in PROMPTS[:3]:
        for seed in range(3):
            ar = pipe.generate(prompt, sampled("exact", seed, 0.0, mode="ar", max_new_tokens=24)).tokens
            out = pipe.generate(prompt, sampled("exact", seed, threshold, max_new_tokens=24))
            assert out.tokens == ar, seed


def test_residual_rule_with_a_confidence_stop_matches_target_sampling(pipe):
    threshold = thresholds(pipe)[1]
    samples, drafted, windows = [], 0, 0
    for seed in range(300_000, 300_000 + RUNS):
        result = pipe.generate(PROMPT, sampled("residual", seed, threshold))
        tokens = result.tokens[:3]
        samples.append(tuple(tokens) + (-1,) * (3 - len(tokens)))
        drafted, windows = drafted + result.stats.drafted, windows + result.stats.windows
    assert drafted < 3 * windows, "the stop must have ended some windows early"
    p = gof_pvalue(samples, reference_distribution(pipe, SamplingParams(**DIST)))
    assert p > ALPHA, f"p = {p:.2e}"


# ---- the planner's replay (runtime/planner/stops.py) and its ranking ------------------------------------------
def test_stopped_length_by_hand():
    from mirrorsd.runtime.planner.stops import stopped_length

    probs = [0.9, 0.2, 0.8, 0.6]
    assert stopped_length(probs, 4, 0.3) == 2  # up to and including the first pick below 0.3
    assert stopped_length(probs, 4, 0.1) == 4  # no pick below: the whole window
    assert stopped_length(probs, 1, 0.3) == 1 and stopped_length(probs, 3, 0.7) == 2
    assert stopped_length(probs, 4, 0.95) == 1
    assert stopped_length([0.9, 0.4], 6, 0.5) == 2  # a window its own stop ended


def test_replay_counts_by_hand():
    from mirrorsd.runtime.planner.stops import StopReplay

    replay = StopReplay(4, thresholds=(0.3, 0.7))
    replay.record([0.9, 0.2, 0.8, 0.6], 3, gamma=4)  # accepted 3 of 4
    replay.record([0.9, 0.4], 1, gamma=4, threshold=0.5)  # drafted with a stop at 0.5: it ended after 0.4
    counts = {(c.gamma, c.threshold): c for c in replay.counts()}
    # (4, 0.3): the first window cut to 2 (accepts 2, commits 3); the second cannot answer (0.3 < 0.5)
    assert (counts[4, 0.3].tokens, counts[4, 0.3].lengths) == (3, (0, 0, 1, 0, 0))
    # (4, 0.7): cut to 2 (commits 3), and the second one's 2 (accepted 1, commits 2)
    assert (counts[4, 0.7].tokens, counts[4, 0.7].lengths) == (5, (0, 0, 2, 0, 0))
    # (1, 0.7): both windows cut to one token, accepted in both: 2 + 2
    assert (counts[1, 0.7].tokens, counts[1, 0.7].lengths) == (4, (0, 2))
    assert counts[3, 0.3].lengths == (0, 0, 1, 0)


def test_replay_of_a_run_equals_that_runs_own_counts(pipe):
    """A run with a stop at t and window g, recorded: the replay at (g, t) is that run's own windows exactly (the
    rollout's stop and the replay's rule agree), and it reaches no (g, t') below the stop it ran with."""
    from mirrorsd.runtime.decoder import DecodeSettings, decode
    from mirrorsd.runtime.planner.stops import StopReplay
    from mirrorsd.runtime.proposers import SerialDraft

    threshold = thresholds(pipe)[1]
    seen = 0
    for prompt in PROMPTS:
        replay = StopReplay(5, thresholds=(threshold / 2, threshold))
        proposer = SerialDraft(pipe.draft, confidence=threshold)
        proposer.record_stops(replay)
        windows = []  # (length, accepted) of each observed window asked with gamma 5
        observe = proposer.observe

        def logged(verdict, new_tokens, next_gamma):
            window, gamma = proposer._window
            if gamma == 5:
                windows.append((len(window.tokens), verdict.accepted))
            observe(verdict, new_tokens, next_gamma)

        proposer.observe = logged
        pipe.draft.reset()
        decode(pipe.target, proposer, list(prompt),
               DecodeSettings(NEW, pipe.manifest.tokenizer.eos_token_ids, pipe.context_limit, 5))
        counts = {(c.gamma, c.threshold): c for c in replay.counts()}
        lengths = [0] * 6
        for length, _ in windows:
            lengths[length] += 1
        assert counts[5, threshold].lengths == tuple(lengths)
        assert counts[5, threshold].tokens == sum(accepted + 1 for _, accepted in windows)
        assert counts[5, threshold / 2].steps == 0  # a lower stop would have drafted past where these ended
        seen += len(windows)
    assert seen > 10


def test_latency_model_ranks_a_stop_from_its_replay():
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, Strategy, predict, rank
    from mirrorsd.runtime.planner.stops import StopCounts

    costs = SplitCosts(2, 2, verify_s=(0.040, 0.042, 0.044, 0.046, 0.048), exit_s=(0.0,) * 5, draft1_s=0.015,
                       branch_fwd_s=0.02, branch_batch=2)
    # 10 windows at (4, 0.5): 6 of one token, 4 of four; 27 tokens committed
    stops = (StopCounts(4, 0.5, 27, (0, 6, 0, 0, 4)),)
    acceptance = Acceptance(0.5, 0.0, stops=stops)
    prediction = predict(costs, Strategy("sd", 4, confidence=0.5), acceptance)
    step = (6 * (0.015 + 0.042) + 4 * (4 * 0.015 + 0.048)) / 10
    assert prediction.step_s == pytest.approx(step) and prediction.tokens_per_step == pytest.approx(2.7)
    names = [r.strategy.name for r in rank([costs], acceptance).rows]
    assert "sd-stop0.5 g4 2+2" in names and not any("stop0.3" in n for n in names)  # only what the replay covers
    assert "sd-stop0.5 g4 2+2" == rank([costs], acceptance).best.strategy.name  # 2.7 / 0.0774 s beats sd and ar
    too_few = Acceptance(0.5, 0.0, stops=(StopCounts(4, 0.5, 5, (0, 2, 0, 0, 1)),))
    assert not any("stop" in r.strategy.name for r in rank([costs], too_few).rows)


def test_profile_keeps_the_stop_counts(tmp_path):
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts
    from mirrorsd.runtime.planner.stops import StopCounts

    costs = SplitCosts(1, 1, verify_s=(0.04, 0.05), exit_s=(0.0, 0.0), draft1_s=0.01, branch_fwd_s=0.01,
                       branch_batch=2)
    stops = (StopCounts(1, 0.3, 17, (0, 9)),)
    profile = profiles.Profile(kind="measured", machine="m", splits=(costs,),
                               acceptance=Acceptance(0.6, 0.1, stops=stops))
    path = tmp_path / "p.json"
    profiles.save(profile, path)
    assert profiles.load(path).acceptance.stops == stops


def test_prefer_and_add_by_hand():
    from mirrorsd.runtime.planner.stops import StopCounts, add, prefer

    prior = (StopCounts(2, 0.5, 30, (0, 10, 10)), StopCounts(2, 0.7, 20, (0, 12, 0)))
    online = (StopCounts(2, 0.5, 5, (0, 3, 1)), StopCounts(2, 0.7, 16, (0, 4, 5)), StopCounts(3, 0.7, 9, (0, 9, 0, 0)))
    # (2, 0.5) has 4 windows online: the prior's stays; (2, 0.7) and (3, 0.7) have 9: this generation's
    assert prefer(online, prior) == (prior[0], online[1], online[2])
    assert add(prior, online) == (StopCounts(2, 0.5, 35, (0, 13, 11)), StopCounts(2, 0.7, 36, (0, 16, 5)), online[2])


def test_prefer_scales_the_stops_a_generation_could_not_measure_by_its_shortfall():
    """A text that accepts less than the calibration at the stop it runs (0.8) makes the prior's lower stops (0.5,
    which it cannot measure) expect less too, by the same ratio: otherwise they stay the calibration's and look
    faster only because nothing has checked them. A text that accepts more leaves the prior as it is."""
    from mirrorsd.runtime.planner.stops import StopCounts, optimism, prefer

    prior = (StopCounts(4, 0.5, 300, (0, 20, 20, 20, 40)),  # 200 accepted over 100 steps: 2.0 per step
             StopCounts(4, 0.8, 250, (0, 40, 30, 20, 10)))  # 150 over 100: 1.5 per step
    online = (StopCounts(4, 0.8, 30, (0, 10, 5, 3, 2)),)  # 10 accepted over 20 steps: 0.5 per step, a third of 1.5
    assert optimism(online, prior) == 1 / 3
    chosen = {c.threshold: c for c in prefer(online, prior)}
    assert chosen[0.8] == online[0]
    assert chosen[0.5] == StopCounts(4, 0.5, 100 + round(200 / 3), prior[0].lengths)  # 0.67 per step, same windows
    better = (StopCounts(4, 0.8, 80, (0, 10, 5, 3, 2)),)  # 3.0 per step: above the prior's, which is kept
    assert optimism(better, prior) == 2.0 and {c.threshold: c for c in prefer(better, prior)}[0.5] == prior[0]
    assert optimism((), prior) == 1.0 and prefer((), prior) == prior
