"""What sd with a draft-confidence stop would have done: the planner's measure of GenerationConfig.draft_confidence.

A window the draft rolled out with every pick's probability recorded (Window.confidence) says what any stop at a
threshold at or above the one it ran with would have drafted from the same point: the window up to its first pick
below the threshold, capped at g tokens. Decoding is greedy-exact and the picks are the same, so that shorter
window's accepted tokens are min(accepted, its length), and the step verifies its length + 1 rows:

    window        probabilities p_1 .. p_n (n = the window it ran: g, or fewer where its own stop ended it)
    stop at t, g  length L = min(g, first j with p_j < t, n); accepted min(A, L); commits that + 1; L + 1 rows

``StopReplay`` keeps, per (g, t) of a small grid, the tokens committed and the steps by verification rows, from
every window it is shown that can answer for that (g, t): drafted with a window of at least g and a threshold of
at most t. The latency model (latency.py) turns the counts into tokens/s with the profile's costs, as it does for
mode ngram's replay (lookup.py). At T > 0 the same counts are an estimate: another window length moves the draws.
"""
from __future__ import annotations

from dataclasses import dataclass

THRESHOLDS = (0.5, 0.7, 0.8, 0.9)  # the stops auto ranks (0: no stop, plain sd, is ranked from alpha)
MIN_STOP_STEPS = 8  # replayed windows before a stop is ranked at all


@dataclass(frozen=True)
class StopCounts:
    """Replayed sd with a stop at one (gamma, threshold): tokens committed, and steps by window length
    (lengths[L] = steps that drafted L tokens and verified L + 1 rows; lengths[0] is always 0)."""

    gamma: int
    threshold: float
    tokens: int
    lengths: tuple[int, ...]

    @property
    def steps(self) -> int:
        return sum(self.lengths)

    def to_list(self) -> list:
        return [self.gamma, self.threshold, self.tokens, list(self.lengths)]

    @classmethod
    def from_list(cls, item) -> "StopCounts":
        gamma, threshold, tokens, lengths = item
        return cls(int(gamma), float(threshold), int(tokens), tuple(int(n) for n in lengths))


def stopped_length(probabilities, gamma: int, threshold: float) -> int:
    """Tokens a window stopped at ``threshold`` and capped at ``gamma`` keeps of one whose picks had these
    probabilities: up to and including its first pick below the threshold."""
    n = min(gamma, len(probabilities))
    for j in range(n):
        if probabilities[j] < threshold:
            return j + 1
    return n


class StopReplay:
    """Counts for every (gamma 1 .. max_gamma, threshold in ``thresholds``) from the windows it is shown."""

    def __init__(self, max_gamma: int, thresholds: tuple[float, ...] = THRESHOLDS) -> None:
        self.max_gamma, self.thresholds = max_gamma, thresholds
        self._tokens = {(g, t): 0 for g in range(1, max_gamma + 1) for t in thresholds}
        self._lengths = {key: [0] * (key[0] + 1) for key in self._tokens}

    def record(self, probabilities, accepted: int, gamma: int, threshold: float = 0.0) -> None:
        """One window drafted with window ``gamma`` and stop ``threshold`` (0: none), its picks' probabilities
        (the window's own length may be shorter: its stop ended it), and the tokens the target accepted."""
        for (g, t), _ in self._tokens.items():
            if g > gamma or t < threshold:
                continue  # that stop would have drafted past where this window ended: unknown
            length = stopped_length(probabilities, g, t)
            self._tokens[(g, t)] += min(accepted, length) + 1
            self._lengths[(g, t)][length] += 1

    def counts(self) -> tuple[StopCounts, ...]:
        return tuple(StopCounts(g, t, self._tokens[(g, t)], tuple(self._lengths[(g, t)])) for g, t in self._tokens)


def stop_at(counts: tuple[StopCounts, ...], gamma: int, threshold: float) -> StopCounts | None:
    """The counts for (gamma, threshold), when they hold MIN_STOP_STEPS windows (else the stop is not ranked)."""
    for c in counts:
        if c.gamma == gamma and c.threshold == threshold and c.steps >= MIN_STOP_STEPS:
            return c
    return None


def prefer(online: tuple[StopCounts, ...], prior: tuple[StopCounts, ...]) -> tuple[StopCounts, ...]:
    """Per (gamma, threshold): this generation's counts where they hold MIN_STOP_STEPS windows, else the prior's,
    with its accepted tokens scaled by shortfall(). A generation only measures the stops at or above its own
    threshold and window: left at the calibration's counts, the ones it cannot measure would keep the calibration's
    acceptance while the measured ones show this text's, and auto would walk toward the stops it had never run
    because only they still looked fast (as it would through untried gammas without auto.corrected's rule for step
    times; lab-notes/performance-log.md, 2026-12-06)."""
    factor = shortfall(online, prior)
    chosen = {(c.gamma, c.threshold): scaled(c, factor) for c in prior}
    chosen.update({(c.gamma, c.threshold): c for c in online if c.steps >= MIN_STOP_STEPS})
    return tuple(chosen.values())


def shortfall(online: tuple[StopCounts, ...], prior: tuple[StopCounts, ...]) -> float:
    """optimism() of ``online``'s counts that hold MIN_STOP_STEPS windows against ``prior``, never above 1: how
    much less this text accepts than the prior, on the stops measured both ways (1.0: no less, or nothing known)."""
    return min(optimism(tuple(c for c in online if c.steps >= MIN_STOP_STEPS), prior), 1.0)


def optimism(measured: tuple[StopCounts, ...], prior: tuple[StopCounts, ...]) -> float:
    """Accepted tokens ``measured`` holds / what the prior's rates predict for the same windows, over the
    (gamma, threshold) both hold (1.0 when none): below 1, the prior expects more than this text gives."""
    rates = {(c.gamma, c.threshold): (c.tokens - c.steps) / c.steps for c in prior if c.steps}
    accepted = expected = 0.0
    for c in measured:
        rate = rates.get((c.gamma, c.threshold))
        if rate is not None:
            accepted += c.tokens - c.steps  # each step commits its accepted tokens + 1
            expected += c.steps * rate
    return accepted / expected if expected > 0 else 1.0


def scaled(counts: StopCounts, factor: float) -> StopCounts:
    """``counts`` with its accepted tokens times ``factor`` (its steps and window lengths, hence its cost, kept)."""
    if factor == 1.0:
        return counts
    accepted = counts.tokens - counts.steps
    return StopCounts(counts.gamma, counts.threshold, counts.steps + round(accepted * factor), counts.lengths)


def add(a: tuple[StopCounts, ...], b: tuple[StopCounts, ...]) -> tuple[StopCounts, ...]:
    """Both replays' windows together, per (gamma, threshold)."""
    total = {(c.gamma, c.threshold): c for c in a}
    for c in b:
        old = total.get((c.gamma, c.threshold))
        if old is None:
            total[(c.gamma, c.threshold)] = c
            continue
        width = max(len(old.lengths), len(c.lengths))
        lengths = tuple((old.lengths[i] if i < len(old.lengths) else 0) + (c.lengths[i] if i < len(c.lengths) else 0)
                        for i in range(width))
        total[(c.gamma, c.threshold)] = StopCounts(c.gamma, c.threshold, old.tokens + c.tokens, lengths)
    return tuple(total.values())
