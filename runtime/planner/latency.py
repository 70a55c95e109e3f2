"""The latency model: tokens/s of ar, sd and mirror predicted from measured step costs and acceptance statistics.

Pure functions of numbers (no sessions, no threads). The costs come from a device profile (runtime/planner/profile.py),
the acceptance statistics from a calibration run or from the running generation (runtime/planner/auto.py).

Glossary (seconds unless said otherwise; w = rows of a verification window = gamma + 1):

    verify(w)     one target pass over w tokens: prefix(w) + suffix(w) + the host's work per step
    exit(w)       the early-exit head on those w rows (mirror with the exit head only)
    draft1        one draft forward of one row, through the rollout engine (host work included)
    branch_fwd    one draft forward of a batch of branch rows (mirror's rollouts)
    c_target      how much longer the target takes while the draft runs at the same time (1.0 = no contention;
                  on one CPU both share the cores and the memory bus)
    c_draft       the same for the draft while the target runs
    alpha         per-token acceptance: P(the target accepts a draft token | it accepted the ones before)
    reuse         fraction of Mirror-SD windows taken from a branch rolled out during verification (a hit)

Step times (the paper's model, docs/algorithm.md "Mirror-SD: what runs at the same time", with the edge's
contention terms and the worker's real schedule):

    ar       T = verify(1)                                                         1 token per step
    sd       T = gamma * draft1 + verify(gamma + 1)                                E[A + 1] tokens per step
    sd, stop T = sum over replayed windows of L * draft1 + verify(L + 1) / steps    tokens / steps (planner/stops.py:
             at t   the windows auto's sd drafted, cut where a stop at t would have ended them: length L <= gamma)
    ngram    T = sum over replayed steps of verify(w) / steps                     tokens / steps (planner/lookup.py:
                                                                           mode ngram replayed on the text itself)
    mirror   the two models share the machine (planner/sharing.py): while both compute, the target runs
             c_target times slower than alone and the draft c_draft times; while one computes, it runs at full
             speed. The target verifies (verify(g + 1), + exit(g + 1) with the exit head); the draft makes one
             forward on the window's last token, waits (exit head on) for the exit's message, which leaves after
             prefix(g + 1) + exit(g + 1) of the target's work, then rolls out its first batch of branches (the
             likeliest, g * branch_fwd) and further batches until the verdict. V: the verdict; F: the first batch
             done (both from that timeline; with c = 1 and no idle stretch, V = verify + exit and F = max(draft1,
             E) + g * branch_fwd)
             hit:  V + wait, wait = F - V when the first batch still runs at the verdict (alone from then on),
                   else 0.5 * branch_fwd (the forward under way)
             miss: V + 0.5 * branch_fwd + g * draft1        (the fallback window is drafted after the verdict)
             T = reuse * hit + (1 - reuse) * miss                                  E[A + 1] tokens per step

    E[A + 1] = (1 - alpha^(gamma + 1)) / (1 - alpha)    (acceptance independent per position)

The draft in mirror runs under the target, so its cost shows up as contention, as the wait for an unfinished
branch and as the miss term, not as gamma * draft1. The contention counts only while both compute: with the exit
head the draft idles until the exit's message, and a factor on the whole verification predicted Mirror-SD 30 %
slower than it ran on a 2-core Intel Xeon.

Over one generation (``predict(..., context=P, new_tokens=N)``) a start-up cost is spread over its N / E[A + 1]
steps: sd prefills the draft with the P context tokens in its first step (draft_prefill * P); mirror's worker does
that during the target's own prefill, except when a generation switches to it mid-way (``switching=True``).
Short answers on long prompts therefore favour ar.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from mirrorsd.runtime.planner.lookup import LookupCounts
from mirrorsd.runtime.planner.sharing import MirrorTimeline, mirror_timeline
from mirrorsd.runtime.planner.stops import THRESHOLDS, StopCounts, stop_at

MODES = ("ar", "sd", "mirror", "ngram")
DRAFTED = ("sd", "mirror")  # the modes that run the draft
MIN_LOOKUP_STEPS = 8  # replayed ngram steps (planner/lookup.py) before ngram is ranked at all
ALPHA_CAP = 0.999  # an acceptance of exactly 1 makes E[A+1] a 0/0 limit; the cap keeps it finite (= gamma + 1)


@dataclass(frozen=True)
class SplitCosts:
    """Measured costs of one placement and thread split (one entry of a profile)."""

    target_threads: int
    draft_threads: int
    verify_s: tuple[float, ...]  # [w - 1] -> verify(w), w = 1 .. len; prefix + suffix + host per step
    exit_s: tuple[float, ...]  # [w - 1] -> exit(w)
    draft1_s: float  # one draft forward, one row, via the rollout engine
    branch_fwd_s: float  # one draft forward of branch_batch rows
    branch_batch: int  # the rows branch_fwd_s was measured with
    c_target: float = 1.0
    c_draft: float = 1.0
    stream_window_s: tuple[float, ...] = ()  # [g - 1] -> a streaming draft's window of g tokens ((): none)
    draft_prefill_s: float = 0.0  # the draft's prefill, per context token (sd pays it in its first step)
    mirror_host_s: tuple[float, ...] = ()  # (with, without the exit head): Mirror-SD's per-step time beyond the
    #                                        model (hand-offs, re-ranking), fitted on the calibration run; () = 0
    prefix_s: tuple[float, ...] = ()  # [w - 1] -> the prefix graph alone (the exit layer's depth); () = unknown
    label: str = ""  # the placement in words, e.g. "target cpu 2t, draft cpu 2t"
    name: str = ""  # a short name for the split in tables ("" = the thread split, e.g. "2+2")
    shared_pool: bool = False  # ONNX Runtime's CPU sessions on the process's one pool (devices/thread_pool.py)

    @property
    def max_gamma(self) -> int:
        return len(self.verify_s) - 1

    @property
    def split(self) -> str:
        return self.name or split_name(self.target_threads, self.draft_threads, self.shared_pool)

    @property
    def key(self) -> tuple[int, int, bool]:
        """(target threads, draft threads, shared pool): what a pipeline's ``thread_key`` matches."""
        return self.target_threads, self.draft_threads, self.shared_pool


def split_name(target_threads: int, draft_threads: int, shared_pool: bool = False) -> str:
    """"2+2" (a pool of its own per session), "2 shared" (one pool of 2 threads for every session)."""
    if shared_pool and target_threads == draft_threads:
        return f"{target_threads} shared"
    return f"{target_threads}+{draft_threads}" + (" shared" if shared_pool else "")


@dataclass(frozen=True)
class Acceptance:
    """The pair's acceptance statistics: per-token acceptance alpha, and Mirror-SD's reuse rate (with and without
    the exit head's candidates). ``source`` says where they come from (calibration, online, hand-written)."""

    alpha: float
    reuse: float
    reuse_noexit: float | None = None  # None: same as reuse
    source: str = "prior"
    lookup: tuple[LookupCounts, ...] = ()  # mode ngram replayed on this generation's text, per gamma 1 .. ((): none)
    stops: tuple[StopCounts, ...] = ()  # sd with a draft-confidence stop replayed on drafted windows ((): none)

    def lookup_at(self, gamma: int) -> LookupCounts | None:
        """The replay at window ``gamma``, when it has MIN_LOOKUP_STEPS steps (else ngram is not ranked)."""
        if gamma > len(self.lookup) or self.lookup[gamma - 1].steps < MIN_LOOKUP_STEPS:
            return None
        return self.lookup[gamma - 1]

    def stop_at(self, gamma: int, threshold: float) -> StopCounts | None:
        """The stop replay at (gamma, threshold), when it has enough windows (else that stop is not ranked)."""
        return stop_at(self.stops, gamma, threshold)

    def reuse_for(self, exit_head: bool) -> float:
        return self.reuse if exit_head or self.reuse_noexit is None else self.reuse_noexit


@dataclass(frozen=True)
class Strategy:
    """One way to run a generation: the mode, its window and branch settings, and the thread split."""

    mode: str
    gamma: int = 0
    exit_head: bool = True
    streaming: bool = False
    split: str = ""  # SplitCosts.split it runs on
    confidence: float = 0.0  # sd: the draft-confidence stop (GenerationConfig.draft_confidence); 0 = none

    @property
    def name(self) -> str:
        if self.mode == "ar":
            return f"ar {self.split}".strip()
        extra = "" if self.mode != "mirror" or self.exit_head else "-noexit"
        stream = "-stream" if self.streaming else ""
        stop = f"-stop{self.confidence:g}" if self.confidence else ""
        return f"{self.mode}{extra}{stream}{stop} g{self.gamma} {self.split}".strip()


@dataclass(frozen=True)
class Prediction:
    strategy: Strategy
    step_s: float
    tokens_per_step: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[A + 1]: tokens a step commits (accepted + the correction) when each draft token is accepted with
    probability alpha given the ones before it. gamma = 0 (ar) commits 1."""
    a = min(max(alpha, 0.0), ALPHA_CAP)
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """The alpha whose expected_tokens(alpha, gamma) is ``mean_accepted`` (SpecBench's mean accepted tokens,
    1 .. gamma + 1), by bisection (the function increases with alpha)."""
    target = min(max(mean_accepted, 1.0), gamma + 1.0)
    lo, hi = 0.0, ALPHA_CAP
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_time(costs: SplitCosts, strategy: Strategy, acceptance: Acceptance) -> float:
    """Seconds per decoding step of ``strategy`` on ``costs`` (see the module docstring)."""
    g = strategy.gamma
    if strategy.mode == "ar":
        return costs.verify_s[0]
    if strategy.mode == "ngram":
        counts = acceptance.lookup_at(g)
        return sum(n * costs.verify_s[w] for w, n in enumerate(counts.widths)) / counts.steps
    if strategy.mode == "sd" and strategy.confidence:
        counts = acceptance.stop_at(g, strategy.confidence)
        return sum(n * (_window_s(costs, length, strategy.streaming) + costs.verify_s[length])
                   for length, n in enumerate(counts.lengths) if n) / counts.steps
    window = _window_s(costs, g, strategy.streaming)
    if strategy.mode == "sd":
        return window + costs.verify_s[g]
    if strategy.mode == "mirror":
        return mirror_step(costs, g, strategy.exit_head, acceptance.reuse_for(strategy.exit_head), window)
    raise ValueError(f"unknown mode {strategy.mode!r}")


def mirror_step(costs: SplitCosts, gamma: int, exit_head: bool, reuse: float, window_s: float) -> float:
    """Mirror-SD's step time (module docstring): the verification under contention, then the wait for the hit
    branch (probability ``reuse``) or the fallback window of ``window_s`` seconds."""
    timeline = mirror_timeline_of(costs, gamma, exit_head)
    if timeline.batch_s > timeline.verdict_s:  # the first batch still runs at the verdict, alone from then on
        hit_wait = timeline.batch_s - timeline.verdict_s
    else:
        hit_wait = 0.5 * costs.branch_fwd_s  # the forward under way
    miss_wait = 0.5 * costs.branch_fwd_s + window_s
    host = costs.mirror_host_s[0 if exit_head else 1] if len(costs.mirror_host_s) == 2 else 0.0
    return timeline.verdict_s + reuse * hit_wait + (1.0 - reuse) * miss_wait + host


def mirror_timeline_of(costs: SplitCosts, gamma: int, exit_head: bool) -> MirrorTimeline:
    """One Mirror-SD step of ``costs`` at window ``gamma`` as the two models share the machine (planner/sharing.py):
    the draft's first batch waits for the exit's message only with the exit head and known prefix times."""
    target = costs.verify_s[gamma] + (costs.exit_s[gamma] if exit_head else 0.0)
    gate = costs.prefix_s[gamma] + costs.exit_s[gamma] if exit_head and len(costs.prefix_s) > gamma else 0.0
    return mirror_timeline(target, gate, costs.draft1_s, gamma * costs.branch_fwd_s, costs.c_target, costs.c_draft)


def exit_arrival_s(costs: SplitCosts, gamma: int) -> float:
    """Seconds after a verification of gamma + 1 rows starts until the early exit's message reaches the draft: the
    prefix and the exit head, sharing the machine with the draft's first forward (0 when the profile has no prefix
    times)."""
    if len(costs.prefix_s) <= gamma:
        return 0.0
    return mirror_timeline_of(costs, gamma, True).exit_s


def _window_s(costs: SplitCosts, gamma: int, streaming: bool) -> float:
    if streaming and len(costs.stream_window_s) >= gamma:
        return costs.stream_window_s[gamma - 1]
    return gamma * costs.draft1_s


def startup_s(costs: SplitCosts, strategy: Strategy, context: int, switching: bool = False) -> float:
    """Seconds a generation of ``strategy`` spends once, outside its steady steps: the draft's prefill of
    ``context`` tokens where it is not hidden under the target's prefill."""
    if strategy.mode == "sd" or (strategy.mode == "mirror" and switching):
        return costs.draft_prefill_s * context
    return 0.0


def predict(costs: SplitCosts, strategy: Strategy, acceptance: Acceptance, context: int = 0, new_tokens: int = 0,
            switching: bool = False) -> Prediction:
    """tokens/s of ``strategy``: E[A + 1] / step time; with ``new_tokens`` the start-up cost is spread over the
    steps of a generation of that many tokens after a ``context``-token text."""
    strategy = replace(strategy, split=costs.split)
    if strategy.mode == "ngram":
        counts = acceptance.lookup_at(strategy.gamma)
        tokens = counts.tokens / counts.steps
    elif strategy.mode == "sd" and strategy.confidence:
        counts = acceptance.stop_at(strategy.gamma, strategy.confidence)
        tokens = counts.tokens / counts.steps
    else:
        tokens = 1.0 if strategy.mode == "ar" else expected_tokens(acceptance.alpha, strategy.gamma)
    step = step_time(costs, strategy, acceptance)
    if new_tokens > 0:
        step += startup_s(costs, strategy, context, switching) / max(new_tokens / tokens, 1.0)
    return Prediction(strategy, step, tokens)


@dataclass(frozen=True)
class Table:
    """Every candidate strategy's prediction, fastest first."""

    rows: tuple[Prediction, ...]
    acceptance: Acceptance
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> Prediction:
        return self.rows[0]

    def best_of(self, mode: str, split: str | None = None, exit_head: bool | None = None) -> Prediction | None:
        for row in self.rows:
            s = row.strategy
            if s.mode == mode and split in (None, s.split) and exit_head in (None, s.exit_head or mode != "mirror"):
                return row
        return None

    def to_dict(self, limit: int = 12) -> dict:
        return {"acceptance": {"alpha": round(self.acceptance.alpha, 4), "reuse": round(self.acceptance.reuse, 4),
                               "reuse_noexit": None if self.acceptance.reuse_noexit is None
                               else round(self.acceptance.reuse_noexit, 4), "source": self.acceptance.source},
                "predicted": [{"strategy": r.strategy.name, "tokens_per_second": round(r.tokens_per_second, 2),
                               "step_ms": round(r.step_s * 1e3, 2), "tokens_per_step": round(r.tokens_per_step, 3)}
                              for r in self.rows[:limit]]}


def candidates(costs: SplitCosts, gammas: tuple[int, ...] | None = None, streaming: bool = False,
               acceptance: Acceptance | None = None) -> list[Strategy]:
    """ar, sd at every gamma, mirror with and without the exit head at every gamma, on one split; ngram at every
    gamma its replay in ``acceptance`` covers, and sd with each draft-confidence stop its replay covers."""
    gammas = gammas or tuple(range(1, costs.max_gamma + 1))
    gammas = tuple(g for g in gammas if 1 <= g <= costs.max_gamma)
    out = [Strategy("ar", split=costs.split)]
    for g in gammas:
        out.append(Strategy("sd", g, streaming=streaming, split=costs.split))
        out += [Strategy("mirror", g, exit_head=e, streaming=streaming, split=costs.split) for e in (True, False)]
        if acceptance is not None and acceptance.lookup_at(g) is not None:
            out.append(Strategy("ngram", g, split=costs.split))
        if acceptance is not None and not streaming:  # (a streaming draft's windows are not replayed)
            out += [Strategy("sd", g, split=costs.split, confidence=t) for t in THRESHOLDS
                    if acceptance.stop_at(g, t) is not None]
    return out


def rank(splits: list[SplitCosts], acceptance: Acceptance, gammas: tuple[int, ...] | None = None,
         streaming: bool = False, context: int = 0, new_tokens: int = 0, current: Strategy | None = None) -> Table:
    """Predict every candidate on every split; fastest first (fastest_first).
    With ``new_tokens``: for a generation of that many tokens after ``context`` tokens; ``current`` is the
    strategy running now (a re-plan: any other one starts from scratch, the current one does not)."""
    rows = []
    for c in splits:
        for s in candidates(c, gammas, streaming and bool(c.stream_window_s), acceptance):
            running = current is not None and replace(s, split="") == replace(current, split="")
            rows.append(predict(c, s, acceptance, 0 if running else context, new_tokens, current is not None))
    return Table(tuple(fastest_first(rows)), acceptance)


def fastest_first(rows: list[Prediction]) -> list[Prediction]:
    """``rows`` fastest first; ties keep the simpler strategy first (ar, then sd). A strategy that runs the draft
    (sd, mirror) but is predicted to commit no more than one token per step goes after every other one whatever its
    predicted speed: its step is ar's (one target pass, one token) plus the draft's work, so a prediction that puts
    it ahead of ar comes from wrong costs (e.g. a correction measured on longer windows, planner/auto.corrected)."""
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(rows, key=lambda p: (p.strategy.mode in DRAFTED and p.tokens_per_step <= 1.0 + 1e-9,
                                       -round(p.tokens_per_second, 9), order[p.strategy.mode], p.strategy.gamma))
