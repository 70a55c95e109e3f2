"""Verification and branch selection: scenario tables and property-based tests (pure functions)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mirrorsd.runtime.stats import overlap_seconds
from mirrorsd.runtime.verify import rank_branches, top2_margin, top_k_logprobs, verify_greedy

SCENARIOS = [  # window, target tokens, accepted, correction
    ([5, 6, 7], [5, 6, 7, 8], 3, 8),  # all accepted: the correction is the bonus token
    ([5, 6, 7], [9, 6, 7, 8], 0, 9),  # first token rejected
    ([5, 6, 7], [5, 9, 7, 8], 1, 9),  # later agreement after a mismatch does not count
    ([5, 6, 7], [5, 6, 1, 8], 2, 1),
    ([], [4], 0, 4),  # no window: plain autoregressive step
]


@pytest.mark.parametrize("window,target,accepted,correction", SCENARIOS)
def test_verify_scenarios(window, target, accepted, correction):
    verdict = verify_greedy(np.array(window, np.int64), np.array(target, np.int64))
    assert (verdict.accepted, verdict.correction) == (accepted, correction)
    assert verdict.bonus == (accepted == len(window))
    assert verdict.branch == (accepted + 1, correction)


def test_verify_rejects_wrong_lengths():
    with pytest.raises(ValueError):
        verify_greedy(np.array([1, 2]), np.array([1, 2]))


@given(st.lists(st.integers(0, 5), min_size=0, max_size=8), st.data())
def test_verify_properties(window, data):
    target = data.draw(st.lists(st.integers(0, 5), min_size=len(window) + 1, max_size=len(window) + 1))
    v = verify_greedy(np.array(window, np.int64), np.array(target, np.int64))
    a = v.accepted
    assert 0 <= a <= len(window)
    assert window[:a] == target[:a]  # everything accepted agrees with the target
    assert a == len(window) or window[a] != target[a]  # and stops at the first disagreement
    assert v.correction == target[a]  # the committed tokens are always the target's own


def random_topk(rng, g, k, vocab=50):
    ids = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(g + 1)])
    logits = rng.normal(size=(g + 1, k))
    lps = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)) - rng.uniform(0, 1)
    order = np.argsort(-lps, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(lps, order, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1), st.booleans(),
       st.floats(0.0, 1.0), st.integers(1, 12))
def test_rank_branches_properties(g, k, seed, with_exit, rate, limit):
    rng = np.random.default_rng(seed)
    draft_ids, draft_lps = random_topk(rng, g, k)
    window = draft_ids[:g, 0].copy()
    exit_ids, exit_lps = random_topk(rng, g, k) if with_exit else (None, None)
    ranked = rank_branches(window, draft_ids, draft_lps, exit_ids, exit_lps, rate, limit=limit)
    assert len(ranked) <= limit
    keys = [(b.depth, b.token) for b in ranked]
    assert len(set(keys)) == len(keys)  # no branch twice
    scores = [b.score for b in ranked]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    for b in ranked:
        assert 1 <= b.depth <= g + 1
        if b.depth <= g:
            assert b.token != window[b.depth - 1]  # a branch corrects the drafted token, never repeats it
    full = rank_branches(window, draft_ids, draft_lps, exit_ids, exit_lps, rate)
    excluded = frozenset(keys)
    rest = rank_branches(window, draft_ids, draft_lps, exit_ids, exit_lps, rate, exclude=excluded)
    assert not excluded & {(b.depth, b.token) for b in rest}
    assert len(rest) == len(full) - len(keys)


def test_rank_branches_prefers_the_bonus_branch_for_a_reliable_draft():
    window = np.array([3, 4])
    ids = np.array([[3, 9], [4, 8], [5, 7]])
    lps = np.log(np.array([[0.6, 0.3], [0.6, 0.3], [0.6, 0.3]]))
    best = rank_branches(window, ids, lps, accept_rate=0.9)[0]
    assert (best.depth, best.token) == (3, 5)
    worst_draft = rank_branches(window, ids, lps, accept_rate=0.1)[0]
    assert (worst_draft.depth, worst_draft.token) == (1, 9)


def test_top_k_and_margin_agree_with_a_full_sort():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    ids, lps = top_k_logprobs(logits, 5)
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=1)[:, :5])
    full = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(lps, np.take_along_axis(full, ids, 1), rtol=1e-5, atol=1e-5)
    srt = np.sort(logits, axis=1)
    np.testing.assert_allclose(top2_margin(logits), srt[:, -1] - srt[:, -2])


@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), max_size=6),
       st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), max_size=6))
def test_overlap_seconds_matches_a_fine_grid(a, b):
    def disjoint(pairs):
        out, end = [], -1.0
        for start, length in sorted(pairs):
            start = max(start, end)
            out.append((start, start + length))
            end = start + length
        return out

    a, b = disjoint(a), disjoint(b)
    grid = np.linspace(0, 40, 40001)
    cover = lambda iv: np.any([(grid >= s) & (grid < e) for s, e in iv], axis=0) if iv else np.zeros_like(grid, bool)
    expected = (cover(a) & cover(b)).sum() * (grid[1] - grid[0])
    assert abs(overlap_seconds(a, b) - expected) < 0.01 * (len(a) + len(b)) + 1e-6
