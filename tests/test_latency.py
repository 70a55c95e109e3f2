"""The latency model's pure functions against cases computed by hand."""
from __future__ import annotations

import pytest

from mirrorsd.runtime.planner.latency import (Acceptance, SplitCosts, Strategy, alpha_from_mean_accepted,
                                              exit_arrival_s, expected_tokens, predict, rank, step_time)
from mirrorsd.runtime.planner.sharing import mirror_timeline

COSTS = SplitCosts(target_threads=2, draft_threads=2,
                   verify_s=(0.036, 0.040, 0.041, 0.042, 0.0435), exit_s=(0.002, 0.002, 0.003, 0.003, 0.004),
                   draft1_s=0.012, branch_fwd_s=0.014, branch_batch=2, c_target=1.5, c_draft=1.25)
HALF = Acceptance(alpha=0.5, reuse=0.6, reuse_noexit=0.4)


def test_expected_tokens_by_hand():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)  # every draft token rejected: the correction only
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)  # 1 + 0.5
    assert expected_tokens(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=1e-2)  # capped just below 1: gamma + 1
    assert expected_tokens(0.7, 0) == 1.0  # ar


@pytest.mark.parametrize("mean,gamma", [(1.0, 4), (1.9375, 4), (3.0, 4), (2.5, 2), (5.0, 4)])
def test_alpha_from_mean_accepted_inverts_expected_tokens(mean, gamma):
    alpha = alpha_from_mean_accepted(mean, gamma)
    assert expected_tokens(alpha, gamma) == pytest.approx(mean, abs=1e-2)
    assert alpha_from_mean_accepted(1.9375, 4) == pytest.approx(0.5, abs=1e-6)


def test_step_times_by_hand():
    assert step_time(COSTS, Strategy("ar"), HALF) == pytest.approx(0.036)
    # sd g4: 4 draft forwards, then one verification of 5 rows
    assert step_time(COSTS, Strategy("sd", 4), HALF) == pytest.approx(4 * 0.012 + 0.0435)
    # mirror g4, exit head: V = 1.5 * (43.5 + 4) = 71.25 ms; first batch F = 1.25 * (12 + 4 * 14) = 85 ms, still
    # running at the verdict: a hit waits (85 - 71.25) / 1.25 = 11 ms; a miss waits 7 + 48 ms. reuse 0.6.
    assert step_time(COSTS, Strategy("mirror", 4), HALF) == pytest.approx(
        0.07125 + 0.6 * 0.011 + 0.4 * (0.007 + 0.048))
    # without the exit head: V = 1.5 * 43.5 = 65.25 ms, hit wait (85 - 65.25) / 1.25 = 15.8 ms, reuse 0.4
    assert step_time(COSTS, Strategy("mirror", 4, exit_head=False), HALF) == pytest.approx(
        0.06525 + 0.4 * 0.0158 + 0.6 * 0.055)
    # g1: F = 1.25 * (12 + 14) = 32.5 ms, done before V = 1.5 * (40 + 2) = 63 ms: a hit waits half a forward (7 ms)
    assert step_time(COSTS, Strategy("mirror", 1), HALF) == pytest.approx(
        0.063 + 0.6 * 0.007 + 0.4 * (0.007 + 0.012))


def test_predict_tokens_per_second_by_hand():
    sd = predict(COSTS, Strategy("sd", 2), HALF)
    assert sd.tokens_per_step == pytest.approx(1.75)
    assert sd.tokens_per_second == pytest.approx(1.75 / (2 * 0.012 + 0.041))
    assert sd.strategy.split == "2+2"
    assert predict(COSTS, Strategy("ar"), HALF).tokens_per_second == pytest.approx(1 / 0.036)


def test_rank_picks_ar_for_a_useless_draft_and_speculation_for_a_perfect_one():
    useless = rank([COSTS], Acceptance(alpha=0.0, reuse=0.0))
    assert useless.best.strategy.mode == "ar"
    perfect = rank([COSTS], Acceptance(alpha=1.0, reuse=1.0))
    assert perfect.best.strategy.mode in ("sd", "mirror") and perfect.best.strategy.gamma == COSTS.max_gamma
    # no contention and every window reused: mirror hides the draft entirely, so it beats sd at the same gamma
    free = SplitCosts(**{**COSTS.__dict__, "c_target": 1.0, "c_draft": 1.0})
    table = rank([free], Acceptance(alpha=0.8, reuse=1.0))
    assert table.best_of("mirror").tokens_per_second > table.best_of("sd").tokens_per_second


def test_a_draft_that_commits_one_token_per_step_never_ranks_above_ar():
    """A drafted strategy predicted to commit one token per step does ar's work plus the draft's: whatever its costs
    say, it goes after ar (costs a hundred times too cheap here, as a correction measured on longer windows can make
    them); with acceptance above zero the same costs rank it first."""
    from mirrorsd.runtime.planner.auto import corrected

    cheap = SplitCosts(**{**COSTS.__dict__, "verify_s": (COSTS.verify_s[0], *(v / 100 for v in COSTS.verify_s[1:])),
                          "draft1_s": COSTS.draft1_s / 100, "branch_fwd_s": COSTS.branch_fwd_s / 100})
    useless = rank([cheap], Acceptance(alpha=0.0, reuse=0.0))
    assert useless.best.strategy.mode == "ar"
    sd1 = useless.best_of("sd")
    assert sd1.tokens_per_step == 1.0 and sd1.tokens_per_second > useless.best.tokens_per_second
    assert rank([cheap], Acceptance(alpha=0.5, reuse=0.0)).best.strategy.mode in ("sd", "mirror")
    # auto's correction: an untried sd takes the factor measured on another strategy; at alpha 0 ar stays first
    fair = rank([COSTS], Acceptance(alpha=0.0, reuse=0.0))
    assert corrected(fair, {Strategy("sd", 6, split="2+2", confidence=0.8): 0.01}).best.strategy.mode == "ar"


def test_rank_compares_thread_splits():
    one = SplitCosts(**{**COSTS.__dict__, "target_threads": 1, "draft_threads": 1,
                        "verify_s": tuple(2 * v for v in COSTS.verify_s), "c_target": 1.0, "c_draft": 1.0})
    table = rank([COSTS, one], Acceptance(alpha=0.0, reuse=0.0))
    assert table.best.strategy.name == "ar 2+2"
    assert table.best_of("ar", "1+1").tokens_per_second == pytest.approx(1 / 0.072)


def test_startup_cost_is_spread_over_a_generation():
    """sd prefills the draft with the context in its first step; over N tokens that costs prefill / (N / E[A+1])
    per step. ar and (not switching) mirror pay nothing."""
    costs = SplitCosts(**{**COSTS.__dict__, "draft_prefill_s": 0.005})
    sd = predict(costs, Strategy("sd", 2), HALF, context=100, new_tokens=35)
    steps = 35 / 1.75  # 20 steps of 1.75 tokens
    assert sd.step_s == pytest.approx(2 * 0.012 + 0.041 + 0.5 / steps)
    assert predict(costs, Strategy("ar"), HALF, context=100, new_tokens=35).step_s == pytest.approx(0.036)
    mirror = predict(costs, Strategy("mirror", 2), HALF, context=100, new_tokens=35)
    assert mirror.step_s == pytest.approx(step_time(costs, Strategy("mirror", 2), HALF))
    switching = predict(costs, Strategy("mirror", 2), HALF, context=100, new_tokens=35, switching=True)
    assert switching.step_s == pytest.approx(mirror.step_s + 0.5 / steps)
    # a long prompt and a short answer: the draft's prefill makes sd slower than ar; a long answer amortizes it
    short = rank([costs], Acceptance(alpha=0.8, reuse=0.0), context=2000, new_tokens=8)
    assert short.best_of("sd").tokens_per_second < short.best_of("ar").tokens_per_second
    long = rank([costs], Acceptance(alpha=0.8, reuse=0.0), context=2000, new_tokens=2000)
    assert long.best_of("sd").tokens_per_second > long.best_of("ar").tokens_per_second
    # the strategy already running pays no start-up again when re-planning
    again = rank([costs], Acceptance(alpha=0.8, reuse=0.0), (2,), context=2000, new_tokens=8,
                 current=Strategy("sd", 2))
    assert again.best_of("sd").step_s == pytest.approx(step_time(costs, Strategy("sd", 2), HALF))


def test_mirror_waits_for_the_exit_when_the_prefix_is_known():
    """With prefix times, the first branch batch starts when the exit's message arrives, and the target computes
    alone while the draft waits for it (processor sharing, planner/sharing.py)."""
    costs = SplitCosts(**{**COSTS.__dict__, "prefix_s": (0.010, 0.015, 0.020, 0.025, 0.030)})
    # g4: the target's work is 43.5 + 4 = 47.5 ms, 30 + 4 = 34 ms of it before the exit's message. Both compute
    # until the draft's forward ends at 1.25 * 12 = 15 ms (the target has done 15 / 1.5 = 10 ms); the target alone
    # does the other 24 ms of its prefix: E = 39 ms. Both again: the target's last 13.5 ms take 20.25 ms, V = 59.25 ms,
    # while the draft does 16.2 ms of its 56 ms batch; the other 39.8 ms it does alone after the verdict (the hit
    # wait). A miss waits 7 + 48 ms. reuse 0.6.
    assert step_time(costs, Strategy("mirror", 4), HALF) == pytest.approx(
        0.05925 + 0.6 * 0.0398 + 0.4 * (0.007 + 0.048))
    assert exit_arrival_s(costs, 4) == pytest.approx(0.039)
    # without the exit head nothing is waited for: the same as without prefix times
    assert step_time(costs, Strategy("mirror", 4, exit_head=False), HALF) == pytest.approx(
        step_time(COSTS, Strategy("mirror", 4, exit_head=False), HALF))


def test_sharing_without_contention_is_the_serial_schedule():
    """c = 1: the verdict is the target's work, the first batch ends at max(draft1, E) + batch."""
    timeline = mirror_timeline(target_s=0.050, gate_s=0.020, draft_one_s=0.012, batch_s=0.040)
    assert (timeline.exit_s, timeline.verdict_s, timeline.batch_s) == pytest.approx((0.020, 0.050, 0.060))
    late = mirror_timeline(target_s=0.050, gate_s=0.005, draft_one_s=0.012, batch_s=0.040)
    assert late.batch_s == pytest.approx(0.052)  # the draft's own forward ends after the exit's message


def test_sharing_slows_only_the_time_both_compute():
    """A draft idle most of the verification slows the target only while it computes; a busy one all along."""
    # gate 40 ms of 50: both compute until the draft's 10 ms forward ends at 20 ms (target: 10 ms done at c 2);
    # the target alone does 30 ms more (E = 50 ms); both again: its last 10 ms take 20 ms (V = 70 ms), the draft
    # does 10 of its 30 ms batch meanwhile and the other 20 ms alone (F = 90 ms)
    idle = mirror_timeline(0.050, 0.040, 0.010, 0.030, c_target=2.0, c_draft=2.0)
    assert (idle.exit_s, idle.verdict_s, idle.batch_s) == pytest.approx((0.050, 0.070, 0.090))
    # no wait for the exit: the draft's forward and batch (40 ms of work) run beside the target all along, and the
    # further batches after it keep the target slowed until the verdict: V = 2 * 50 ms
    busy = mirror_timeline(0.050, 0.0, 0.010, 0.030, c_target=2.0, c_draft=2.0)
    assert (busy.exit_s, busy.verdict_s, busy.batch_s) == pytest.approx((0.0, 0.100, 0.080))
    # the old one-factor model (c_target on the whole verification) is the upper bound of the verdict
    for gate in (0.0, 0.01, 0.03, 0.05):
        assert mirror_timeline(0.050, gate, 0.010, 0.030, 2.0, 2.0).verdict_s <= 2.0 * 0.050 + 1e-12


EXIT = SplitCosts(target_threads=1, draft_threads=1, verify_s=(0.040,) * 3, exit_s=(0.002,) * 3,
                  prefix_s=(0.020,) * 3, draft1_s=0.010, branch_fwd_s=0.012, branch_batch=2)


def test_exit_layer_table_by_hand():
    """Exit measured at layer 14 of 28 (prefix 20 ms), reuse 0.6 with it and 0.4 without, trained top-4 0.2 / 0.4 /
    0.6 at layers 7 / 14 / 21. gamma 2: V = 40 + 2 = 42 ms; a miss waits 6 + 2 * 10 = 26 ms.
        L   reuse                     E (exit arrives)   F = max(10, E) + 24   hit wait            step
        7   0.4 + 0.2 * 0.2/0.4 = 0.5   10 + 2 = 12       36 < 42              0.5 * 12 = 6 ms     42 + 3 + 13 = 58
        14  0.6                         20 + 2 = 22       46                   46 - 42 = 4 ms      42 + 2.4 + 10.4 = 54.8
        21  0.7                         30 + 2 = 32       56                   14 ms               42 + 9.8 + 7.8 = 59.6
    The middle layer wins: a shallower exit names the token less often, a deeper one arrives too late."""
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table, format_exit_table, interpolate, reuse_at

    acceptance = Acceptance(alpha=0.5, reuse=0.6, reuse_noexit=0.4)
    rows = exit_layer_table(EXIT, acceptance, {7: 0.2, 14: 0.4, 21: 0.6}, base_layer=14, gammas=(2,))
    by_layer = {r.layer: r for r in rows}
    assert [r.layer for r in rows] == [14, 7, 21]  # fastest first
    for layer, reuse, arrival, step in ((7, 0.5, 0.012, 0.058), (14, 0.6, 0.022, 0.0548), (21, 0.7, 0.032, 0.0596)):
        r = by_layer[layer]
        assert (r.reuse, r.arrival_s, r.step_s) == pytest.approx((reuse, arrival, step)), layer
        assert r.tokens_per_second == pytest.approx(1.75 / step)
    assert interpolate({7: 0.2, 21: 0.6}, 14) == pytest.approx(0.4)
    assert interpolate({7: 0.2, 21: 0.6}, 28) == pytest.approx(0.6)
    assert reuse_at(1.0, 0.4, 0.6, 0.4) == pytest.approx(0.9)
    assert reuse_at(0.0, 0.0, 0.6, 0.4) == pytest.approx(0.6)  # no slope to scale: the measured reuse
    text = format_exit_table(rows, layers=28)
    assert "best exit layer: 14" in text and "| 21/28 |" in text and "PREDICTED" in text


def test_exit_layer_needs_the_prefix_time():
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table

    with pytest.raises(ValueError, match="prefix_s"):
        exit_layer_table(COSTS, HALF, {7: 0.2, 14: 0.4}, base_layer=14)


def test_sharing_gives_up_on_costs_that_are_not_finite():
    """A timeline of infinite or NaN costs is infinite (the strategy ranks last), never an endless loop."""
    for bad in (float("inf"), float("nan")):
        assert mirror_timeline(0.05, 0.02, bad, 0.03, 2.0, 2.0).verdict_s == float("inf")
        assert mirror_timeline(0.05, 0.02, 0.01, 0.03, bad, 2.0).batch_s == float("inf")


def test_sharing_bounds_on_random_steps():
    """Whatever the costs: the verdict lies between the target's work alone and c_target times it, the first batch
    ends no sooner than the draft's work alone and the exit's message, and the message leaves before the verdict."""
    import random

    rng = random.Random(7)
    for _ in range(500):
        target, draft_one, batch = rng.uniform(0.001, 0.1), rng.uniform(0.0, 0.05), rng.uniform(0.0, 0.2)
        gate = rng.choice([0.0, rng.uniform(0.0, target)])
        c_target, c_draft = rng.uniform(1.0, 4.0), rng.uniform(1.0, 4.0)
        t = mirror_timeline(target, gate, draft_one, batch, c_target, c_draft)
        assert target - 1e-9 <= t.verdict_s <= c_target * target + 1e-9
        assert t.batch_s >= draft_one + batch - 1e-9 and t.batch_s >= t.exit_s + batch - 1e-9
        assert gate - 1e-9 <= t.exit_s <= t.verdict_s + 1e-9
