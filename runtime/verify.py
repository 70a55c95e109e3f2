"""Verification and branch selection: pure NumPy, no sessions, no threads.

Glossary
    window      the draft's proposal y^1..y^g (g = gamma tokens) after the last committed token
    target      the target's own greedy tokens y1..y(g+1): y_i follows committed + y^1..y^(i-1)
    accepted    A = the longest prefix of the window that equals the target's tokens (0..g)
    correction  c = y(A+1): the target's token where the window first differs
    bonus       the correction when the whole window was accepted (A = g)
    branch      (depth d, token v): "the target accepts y^1..y^(d-1), then its token at d is v"; Mirror-SD
                pre-computes the draft's next window for likely branches; the verdict (A, c) hits branch (A+1, c)
Sampling (T > 0; runtime/sampling.py makes the distributions and the uniforms, these functions only decide)
    p_i         the target's processed distribution at window position i (after its tokens y^1..y^(i-1))
    q_i         the draft's processed distribution that window token y^i was drawn from
    exact       the target draws its own token y_i ~ p_i; A = longest prefix where y^i == y_i; c = y_(A+1)
    residual    speculative sampling: accept y^i with probability min(1, p_i(y^i) / q_i(y^i)); at the first
                rejection c ~ norm(max(0, p_i - q_i)); when all g are accepted the bonus c ~ p_(g+1)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    accepted: int
    correction: int
    drafted: int

    @property
    def bonus(self) -> bool:
        return self.accepted == self.drafted

    @property
    def branch(self) -> tuple[int, int]:
        """The branch key that the next window must come from: (A + 1, c)."""
        return self.accepted + 1, self.correction


def verify_greedy(window: np.ndarray, target_tokens: np.ndarray) -> Verdict:
    """window [g] draft tokens, target_tokens [g + 1] target argmaxes -> Verdict(A, c)."""
    g = len(window)
    if len(target_tokens) != g + 1:
        raise ValueError(f"need {g + 1} target tokens for a window of {g}, got {len(target_tokens)}")
    mismatches = np.flatnonzero(np.asarray(window) != np.asarray(target_tokens[:g]))
    accepted = int(mismatches[0]) if mismatches.size else g
    return Verdict(accepted, int(target_tokens[accepted]), g)


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """probs [V] (non-negative, any positive total), u in [0, 1) -> the token whose CDF interval holds u.

    A token of probability 0 owns an empty interval, so it is never returned.
    """
    support = np.flatnonzero(probs > 0)
    if support.size == 0:
        raise ValueError("cannot sample from a distribution with no mass")
    cdf = np.cumsum(probs[support], dtype=np.float64)
    j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(support[min(j, support.size - 1)])


def verify_exact_sampled(window: np.ndarray, target_probs, uniforms: np.ndarray) -> Verdict:
    """The exact-match rule: window [g], target_probs [g + 1, V] rows p_i, uniforms [g + 1] -> Verdict(A, c).

    The target draws y_i = inverse_cdf(p_i, u_i) and the window is accepted up to the first y^i != y_i; c is
    that y_i (the bonus y_(g+1) when all match). Every committed token is a target draw. p_(i+1) is conditioned on
    y^1..y^i, which equals the committed text only while everything so far was accepted: so rows after the first
    mismatch are never read (``target_probs`` may compute its rows lazily).
    """
    g = len(window)
    if len(uniforms) != g + 1:
        raise ValueError(f"need {g + 1} uniforms for a window of {g}, got {len(uniforms)}")
    for i in range(g + 1):
        y = inverse_cdf(target_probs[i], float(uniforms[i]))
        if i == g or y != int(window[i]):
            return Verdict(i, y, g)
    raise AssertionError("unreachable")


def residual_distribution(p: np.ndarray, q: np.ndarray, rejected: int) -> np.ndarray:
    """norm(max(0, p - q)) [V], which is 0 at the ``rejected`` token (rejecting x means p(x) <= u q(x) < q(x)).

    Where p <= q everywhere (p == q up to rounding, so a rejection had probability 0) it falls back to p without
    the rejected token: a correction never repeats the window token it replaces (the draft already holds that one).
    """
    residual = np.maximum(np.asarray(p, np.float64) - np.asarray(q, np.float64), 0.0)
    if residual.sum() <= 0:
        residual = np.array(p, np.float64)
    residual[rejected] = 0.0
    return residual / residual.sum()


def verify_residual(window: np.ndarray, draft_probs: np.ndarray, target_probs, accept_uniforms: np.ndarray,
                    sample_uniforms: np.ndarray) -> Verdict:
    """Speculative sampling: window [g], draft_probs [g, V] rows q_i, target_probs [g + 1, V] rows p_i,
    accept_uniforms [g], sample_uniforms [g + 1] -> Verdict(A, c).

    y^i is accepted when u_i * q_i(y^i) < p_i(y^i), i.e. with probability min(1, p/q) (a token the draft could
    not have drawn, q = 0, is accepted whenever p > 0). At the first rejection c = inverse_cdf(residual, v_i);
    after g acceptances the bonus c = inverse_cdf(p_(g+1), v_(g+1)). Rows after the verdict are never read.
    """
    g = len(window)
    if (g and (draft_probs is None or len(draft_probs) < g)) or len(accept_uniforms) < g \
            or len(sample_uniforms) != g + 1:
        raise ValueError(f"a window of {g} needs {g} draft rows, {g} accept and {g + 1} sample uniforms")
    for i in range(g):
        x, p, q = int(window[i]), target_probs[i], draft_probs[i]
        if float(accept_uniforms[i]) * float(q[x]) < float(p[x]):
            continue
        return Verdict(i, inverse_cdf(residual_distribution(p, q, x), float(sample_uniforms[i])), g)
    return Verdict(g, inverse_cdf(target_probs[g], float(sample_uniforms[g])), g)


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """logits [S, vocab] -> argmax ids [S] (first index on exact ties, like torch.argmax)."""
    return np.argmax(logits, axis=-1)


def top_k_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """logits [S, vocab] -> (ids [S, k], log-probs [S, k]) sorted by decreasing probability."""
    k = min(k, logits.shape[-1])
    ids = np.argpartition(-logits, k - 1, axis=-1)[:, :k]  # [S, k] unordered
    top = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-top, axis=-1, kind="stable")
    ids, top = np.take_along_axis(ids, order, -1), np.take_along_axis(top, order, -1)
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = peak + np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))
    return ids, top - log_norm


def top1_probability(logits: np.ndarray) -> np.ndarray:
    """logits [S, vocab] -> the softmax probability of each row's argmax [S]: the draft's confidence in its
    greedy pick, which a confidence-stopped window (rollout.py) compares with its threshold. float32 throughout
    (a float64 copy of a 151936-id row costs ten times the 0.4 ms this takes)."""
    logits = np.asarray(logits, np.float32)
    shifted = logits - logits.max(axis=-1, keepdims=True)  # [S, vocab], <= 0
    np.exp(shifted, out=shifted)
    return 1.0 / shifted.sum(axis=-1)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """logits [S, vocab] -> top-1 minus top-2 logit [S] (near-tie detector for the tie-aware oracle)."""
    part = np.partition(logits, -2, axis=-1)
    return part[..., -1] - part[..., -2]


@dataclass
class AcceptanceEstimate:
    """Running per-token acceptance probability: accepted / (accepted + rejections), exponentially decayed."""

    accepted: float = 7.0  # prior: 0.7 with the weight of a few steps
    rejected: float = 3.0
    decay: float = 0.95

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, verdict: Verdict) -> None:
        self.accepted = self.decay * self.accepted + verdict.accepted
        self.rejected = self.decay * self.rejected + (0 if verdict.bonus else 1)


@dataclass(frozen=True)
class Branch:
    depth: int  # 1..g+1
    token: int
    score: float  # estimated probability that the verdict is exactly (depth, token)


def rank_branches(window: np.ndarray, draft_ids: np.ndarray, draft_logprobs: np.ndarray,
                  exit_ids: np.ndarray | None = None, exit_logprobs: np.ndarray | None = None,
                  accept_rate: float = 0.7, exclude: frozenset[tuple[int, int]] = frozenset(),
                  limit: int | None = None) -> list[Branch]:
    """Candidate branches ranked by the estimated probability that the verdict is exactly (d, v), best first.

    window [g]; draft_ids/draft_logprobs [g + 1, k_d]: the draft's top tokens at each window position (row g is
    the position after the window); exit_ids/exit_logprobs [g + 1, k_e]: the early exit's top tokens, if known
    (id -1: none; a source that lists no token at d is left out there).
    accept_rate a: the measured chance that the target accepts a drafted token (the draft's own softmax is not
    calibrated for that, so acceptance is modelled as geometric: P(A >= d) = a^d).
    q_d(v) = the sources' estimate of v at d:
        the exit lists only tokens the draft lists (a sparse exit head scored the draft's candidates): the draft's
            probabilities re-weighted by the exit's (product of experts), scaled back to the draft's total there;
        otherwise: the mean of the sources' probabilities (a source that does not list v gives 0);
        d <= g:  score(d, v) = a^(d-1) * (1 - a) * q_d(v) / (1 - q_d(window_d)),   v != window_d
        d = g+1: score(d, v) = a^g * q_d(v)                                         (the bonus token)
    """
    g = len(window)
    a = float(min(max(accept_rate, 0.0), 1.0))
    ranked = []
    for d in range(g + 1):
        probs = _position_probs(draft_ids[d], draft_logprobs[d],
                                None if exit_ids is None else exit_ids[d], None if exit_ids is None else exit_logprobs[d])
        if d < g:
            drafted = int(window[d])
            miss = max(1.0 - probs.get(drafted, 0.0), 1e-6)
            weight = a**d * (1.0 - a) / miss
        else:
            drafted, weight = None, a**g
        for tok, p in probs.items():
            key = (d + 1, tok)
            if tok != drafted and key not in exclude and weight * p > 0:
                ranked.append(Branch(d + 1, tok, weight * p))
    ranked.sort(key=lambda b: (-b.score, b.depth, b.token))
    return ranked[:limit] if limit is not None else ranked


def _position_probs(draft_ids, draft_lps, exit_ids, exit_lps) -> dict[int, float]:
    """q_d over the tokens listed at one position (see rank_branches)."""
    listed = [(ids, lps) for ids, lps in ((draft_ids, draft_lps), (exit_ids, exit_lps))
              if ids is not None and (ids >= 0).any()]
    rows = [{t: p for t, p in zip(ids.tolist(), np.exp(lps).tolist()) if t >= 0} for ids, lps in listed]
    if len(rows) == 2 and rows[1].keys() <= rows[0].keys():  # a sparse exit: re-weight the draft's candidates
        draft, exit_p = rows
        joint = {t: p * exit_p.get(t, 0.0) for t, p in draft.items()}
        total = sum(joint.values())
        if total > 0:
            scale = sum(draft.values()) / total
            return {t: p * scale for t, p in joint.items()}
    probs: dict[int, float] = {}
    for row in rows:
        for tok, p in row.items():
            probs[tok] = probs.get(tok, 0.0) + p / len(rows)
    return probs


def exit_candidates(draft_top: np.ndarray, rows: int) -> np.ndarray:
    """The tokens a sparse exit head scores: draft_top [g', k] (the draft's top-k at each window position) ->
    candidates [rows, k] for the verification rows [last] + window: row d < rows - 1 takes the draft's top-k at window
    position d + 1; the last row (the position after the window, which the draft has not reached yet) gets -1 (none)."""
    out = np.full((rows, draft_top.shape[1]), -1, np.int64)
    take = min(rows - 1, len(draft_top))
    out[:take] = draft_top[:take]
    return out


def candidate_logprobs(candidates: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """candidates [S, m] (-1: none), logits [S, m] at them -> (ids [S, m], log-probs [S, m]) best first, log-probs
    normalised over each row's candidates (a sparse head does not see the rest of the vocabulary); -1 / -inf where
    a row has fewer candidates."""
    valid = candidates >= 0
    masked = np.where(valid, logits.astype(np.float64), -np.inf)
    peak = np.max(np.where(valid, masked, np.finfo(np.float64).min), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = peak + np.log(np.sum(np.where(valid, np.exp(masked - peak), 0.0), axis=-1, keepdims=True))
        logprobs = np.where(valid, masked - norm, -np.inf)
    order = np.argsort(-logprobs, axis=-1, kind="stable")
    ids = np.where(np.take_along_axis(valid, order, -1), np.take_along_axis(candidates, order, -1), -1)
    return ids.astype(np.int64), np.take_along_axis(logprobs, order, -1).astype(np.float32)
