"""``--mode auto``: run the strategy the latency model predicts fastest, and re-plan when the prediction fails.

    plan      rank ar, sd and mirror (with and without the exit head) at every gamma on the pipeline's own thread
              split (runtime/planner/latency.py), from its measured profile and the pair's acceptance (calibration, then
              what earlier generations measured); take the fastest
    generate  the chosen proposer does the work; every step's wall time and committed tokens are recorded
    correct   every RECHECK_STEPS steps, a running strategy that measured more seconds per step than the profile
              predicts gets that factor on its step time for the rest of the generation (and so does every
              strategy of several rows per step not run yet: they share the wide verify's cost); every later
              ranking (re-plan, ar probe) uses the corrected times. A profile taken on a busy machine, wrong for
              one strategy, is corrected by what that strategy ran at. Only ever dearer: a strategy measured
              faster than profiled keeps its prediction, since the strategies it is ranked against were not
              measured (a machine faster than its profile all round must not make the running one look best)
    re-plan   when the last RECHECK_STEPS steps ran more than SLACK below the prediction, rank again with the
              acceptance measured so far in this generation (e.g. acceptance collapsed: drop to ar) and the
              corrected step times. It switches only to a strategy predicted REPLAN_MARGIN faster than the running
              one's corrected prediction (what it measured): closer than that the model cannot tell them apart
              (its validation allows 15 %); two near-ties it took on a 2-core AVX2 EPYC (predicted 1.6 % and
              2.2 % faster) ran 12 % and 3 % slower than the strategy they left. If the same strategy stays, so
              does its corrected prediction, so it does not re-plan every 16 steps for nothing. From sd or mirror,
              ngram is ranked on the lookup replay since the previous check only, as below
    lookup    every step the committed text is replayed as mode ngram would have decoded it (planner/lookup.py);
              every RECHECK_STEPS steps, auto takes ngram when the latency model predicts it LOOKUP_MARGIN faster
              than the strategy running (code that repeats names, answers that quote their question); from ar,
              LOOKUP_MARGIN_FROM_AR (neither has a draft: the switch itself costs nothing). From sd or mirror the
              prediction uses only the replay since the previous check, never the answer's opening (so not at the
              first check): an opening often restates the prompt, so a young replay's average overstates what
              lookup will copy next (a coding answer replayed 3.5 tokens per step over its first 24 tokens, 1.95
              over 40, 1.0 from 40 to 64, 1.18 over 128, and auto left an sd accepted at 0.93 for an ngram that
              then ran 20-25 % slower than sd)
    leave ar  while in ar or ngram (the draft idle), the draft is probed every PROBE_STEPS steps on the committed
              text (planner/ar_probe.py: teacher-forced, the target's tokens untouched) and the strategies ranked
              again with the alpha it measured; auto leaves when another strategy is predicted LEAVE_MARGIN faster
              than the one running
    switch    the old proposer is finished (a Mirror-SD worker stops) and the new one starts from the committed
              text: the draft's cache is rebuilt by its prefill. Every mode is lossless, so the tokens stay the
              target's whatever it switches to (tests/test_auto.py checks parity with ar across switches)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mirrorsd.runtime.planner.ar_probe import PROBE_STEPS, ArProbe, leave_ar, speculation_can_pay
from mirrorsd.runtime.planner.latency import (DRAFTED, Acceptance, Prediction, SplitCosts, Strategy, Table,
                                              alpha_from_mean_accepted, expected_tokens, fastest_first, rank)
from mirrorsd.runtime.planner.lookup import LookupCounts, LookupReplay
from mirrorsd.runtime.planner.stops import StopReplay, add, prefer, shortfall
from mirrorsd.runtime.rollout import Window
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import Verdict

RECHECK_STEPS = 16  # steps per check of the measured speed against the prediction
SLACK = 0.10  # re-plan when the measured speed is more than this fraction below the prediction
MIN_ONLINE_STEPS = 8  # speculative steps before this generation's own acceptance replaces the prior
LOOKUP_MARGIN = 0.10  # take ngram when predicted this much faster than the running strategy (its replay is young)
LOOKUP_MARGIN_FROM_AR = 0.02  # ... from ar: no draft on either side, the switch costs nothing, so a small gain pays
REPLAN_MARGIN = 0.05  # a re-plan leaves the running strategy only for one predicted this much faster than it


@dataclass
class OnlineStats:
    """Acceptance measured during this generation: per-position acceptance and Mirror-SD's reuse."""

    tried: int = 0  # draft positions the target judged: accepted ones, plus the first rejected one of a step
    accepted: int = 0
    steps: int = 0  # speculative steps
    windows: dict = field(default_factory=lambda: {True: 0, False: 0})  # mirror windows by exit head
    reused: dict = field(default_factory=lambda: {True: 0, False: 0})

    def record(self, verdict: Verdict, strategy: Strategy, reused: bool) -> None:
        if verdict.drafted == 0 or strategy.mode == "ngram":  # copied windows say nothing of the draft
            return
        if strategy.confidence:  # windows cut where the draft was unsure: their acceptance is not alpha's (the
            return  # stop replay, planner/stops.py, measures them)
        self.steps += 1
        self.accepted += verdict.accepted
        self.tried += verdict.accepted + (verdict.accepted < verdict.drafted)
        if strategy.mode == "mirror":
            self.windows[strategy.exit_head] += 1
            self.reused[strategy.exit_head] += int(reused)

    def acceptance(self, prior: Acceptance) -> Acceptance:
        """The prior with what this generation measured in its place (where it measured enough)."""
        alpha = self.accepted / self.tried if self.steps >= MIN_ONLINE_STEPS and self.tried else prior.alpha

        def reuse(exit_head: bool, old: float | None) -> float | None:
            n = self.windows[exit_head]
            return self.reused[exit_head] / n if n >= MIN_ONLINE_STEPS else old

        measured = alpha != prior.alpha or reuse(True, None) is not None or reuse(False, None) is not None
        return Acceptance(alpha, reuse(True, prior.reuse), reuse(False, prior.reuse_noexit),
                          "online" if measured else prior.source, stops=prior.stops)


def blend(old: Acceptance, new: Acceptance, weight: float = 0.5) -> Acceptance:
    """What the next generation plans from: ``new`` (one generation's measurement) averaged into ``old`` with
    ``weight`` (running_weight: a running mean over the generations, the calibration counting as its prompts); the
    stop replays' windows added up."""
    stops = add(old.stops, new.stops)
    if new.source != "online":
        return replace(old, stops=stops)

    def mix(a: float | None, b: float | None) -> float | None:
        return b if a is None else a if b is None else (1 - weight) * a + weight * b

    return Acceptance(mix(old.alpha, new.alpha), mix(old.reuse, new.reuse), mix(old.reuse_noexit, new.reuse_noexit),
                      "calibration + online", stops=stops)


def tempered_alpha(alpha: float, factor: float, gamma: int) -> float:
    """The alpha whose window of ``gamma`` accepts ``factor`` times the tokens ``alpha``'s does (factor 1: alpha)."""
    if factor >= 1.0:
        return alpha
    return alpha_from_mean_accepted(1.0 + factor * (expected_tokens(alpha, gamma) - 1.0), gamma)


def running_weight(generations: int, calibration_prompts: int) -> float:
    """The weight of the ``generations``-th measured generation (1, 2, ...) in a running mean that starts from a
    calibration over ``calibration_prompts`` prompts. Acceptance differs widely between prompts (code vs prose), so
    the previous generation alone (a fixed weight of 0.5) is a poor prior for the next one."""
    return 1.0 / (generations + max(calibration_prompts, 1))


@dataclass(frozen=True)
class Switch:
    step: int
    old: str
    new: str
    measured_tps: float
    predicted_tps: float
    reason: str


def plan_table(costs: SplitCosts, acceptance: Acceptance, streaming: bool = False, max_gamma: int | None = None,
               context: int = 0, new_tokens: int = 0, current: Strategy | None = None) -> Table:
    """Every strategy on the pipeline's own split, fastest first, for a generation of ``new_tokens`` after
    ``context`` tokens (``current``: the strategy already running, which has no start-up cost left)."""
    gammas = tuple(range(1, min(max_gamma or costs.max_gamma, costs.max_gamma) + 1))
    return rank([costs], acceptance, gammas, streaming, context, new_tokens, current)


WIDE = ("sd", "mirror", "ngram")  # the modes that verify windows of several rows: they share that cost (and the draft's)
TARGET_ONLY = ("ar", "ngram")  # the modes whose step is the target alone (no draft forward)


def corrected(table: Table, step_factor: dict[Strategy, float]) -> Table:
    """``table`` with each measured strategy's step time scaled by ``step_factor`` (measured / predicted seconds
    per step), fastest first again. A strategy not run yet takes the largest factor measured on the strategies
    whose step holds the same parts (else auto would walk through every untried gamma and mode, each predicted
    from the same bad costs):
        sd, mirror   any measured strategy of several rows per step (sd, mirror, ngram): they share the
                     multi-row verify's cost, and sd and mirror the draft's
        ngram        a measured ngram or ar: its step is the target's verify alone. A draft slower than profiled
                     (what an sd factor mostly measures) says nothing of it; giving it sd's factor kept auto in ar
                     on text where prompt lookup paid"""
    if not step_factor:
        return table
    drafted = max((f for s, f in step_factor.items() if s.mode in WIDE), default=1.0)
    target_only = max((f for s, f in step_factor.items() if s.mode in TARGET_ONLY), default=1.0)
    untried = {"sd": drafted, "mirror": drafted, "ngram": target_only}
    rows = [Prediction(r.strategy, r.step_s * step_factor.get(r.strategy, untried.get(r.strategy.mode, 1.0)),
                       r.tokens_per_step)
            for r in table.rows]
    return replace(table, rows=tuple(fastest_first(rows)))


def why(table: Table) -> str:
    best = table.best
    runner = next((r for r in table.rows[1:] if r.strategy.mode != best.strategy.mode), None)
    ar = table.best_of("ar")
    text = f"{best.strategy.name}: predicted {best.tokens_per_second:.1f} tok/s"
    if runner is not None:
        text += f", next best {runner.strategy.name} {runner.tokens_per_second:.1f}"
    if ar is not None and best.strategy.mode != "ar":
        text += f", ar {ar.tokens_per_second:.1f}"
    a = table.acceptance
    return text + f" (alpha {a.alpha:.2f}, reuse {a.reuse:.2f}/{a.reuse_noexit if a.reuse_noexit is not None else a.reuse:.2f} " \
                  f"with/without exit head, {a.source})"


class AutoProposer:
    """A proposer that delegates to the one the latency model picks, and switches when the prediction fails."""

    mode = "auto"

    def __init__(self, make: Callable[[Strategy], object], costs: SplitCosts, prior: Acceptance,
                 streaming: bool = False, max_gamma: int | None = None, context: int = 0,
                 new_tokens: int = 0, probe: ArProbe | None = None) -> None:
        self._make = make  # Strategy -> a proposer (TargetOnly, SerialDraft, MirrorProposer)
        self.costs, self.prior = costs, prior
        self.context, self.new_tokens = context, new_tokens  # the prompt's tokens; the tokens asked for
        self.step_factor: dict[Strategy, float] = {}  # measured / predicted seconds per step, per strategy run
        self._profiled = lambda acceptance, current=None: plan_table(
            costs, acceptance, streaming, max_gamma, self.context + self.generated,
            max(self.new_tokens - self.generated, 0), current)  # the profile's own predictions
        self._plan = lambda acceptance, current=None: corrected(self._profiled(acceptance, current),
                                                                self.step_factor)
        self.generated = 0
        self.table = self._plan(prior)
        self.first_table = self.table
        self.current: Prediction = self.table.best
        self.first = self.current
        self.scale = 1.0  # measured / predicted speed when a re-plan kept the same strategy
        self.inner = None
        self.sampler: Sampler = GREEDY
        self.online = OnlineStats()
        self.switches: list[Switch] = []
        self.branches = 0  # Mirror-SD branches rolled out by finished inner proposers
        self._pending: Prediction | None = None
        self._recent: list[tuple[float, int]] = []  # (seconds, tokens) of the steps since the last check
        self._last = 0.0
        self._reused = False
        self._step = 0
        self.probe = probe  # measures the draft's acceptance while in ar (None: ar stays ar for the generation)
        self._probing = False
        self._probe_due = False
        self._ar_steps = 0
        self.replay = LookupReplay(max(costs.max_gamma, 1))  # mode ngram replayed on the committed text
        self.stops = StopReplay(max(costs.max_gamma, 1))  # the draft-confidence stops replayed on sd's windows
        self._replayed_at_check: tuple[LookupCounts, ...] = ()  # the replay's counts at the last check
        self._prompt_tokens = 0

    @property
    def strategy(self) -> Strategy:
        return self.current.strategy

    # ---- the proposer interface -------------------------------------------------------------------------------
    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        self.sampler = sampler
        self.stops = StopReplay(self.stops.max_gamma)
        self.inner = self._start(self.strategy)
        self.inner.reset(prompt, sampler)
        self._prompt_tokens = len(prompt)
        self.replay = LookupReplay(self.replay.max_gamma)
        self._replayed_at_check = ()
        self._last = 0.0  # set by the first propose: the prefill is no step
        self._probing = self.probe is not None and sampler.plain and speculation_can_pay(self._plan, self.prior)
        if self._probing:
            self.probe.start(len(prompt))

    def propose(self, committed: list[int], gamma: int) -> Window:
        if not self._last:
            self._last = time.perf_counter()
            self.replay.start(committed[:self._prompt_tokens], committed[self._prompt_tokens])
        self.replay.follow(committed)
        if self._probe_due:  # the probe's draft forward is no part of the running strategy's step: not timed in it
            started = time.perf_counter()
            self._probe(committed)
            self._last += time.perf_counter() - started
        if self._pending is not None:
            self._switch(committed)
        g = min(gamma, self.strategy.gamma)
        window = self.inner.propose(committed, g) if g > 0 else Window.empty(target_only=True)
        self._reused = bool(window.reused)
        return window

    def exit_callback(self):
        return self.inner.exit_callback() if self.strategy.mode == "mirror" else None

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        self._record(verdict, len(new_tokens))
        if self._pending is None and self.strategy.mode != "ar":
            self.inner.observe(verdict, new_tokens, min(next_gamma, self.strategy.gamma))

    def finish(self, timeout: float | None = None) -> None:
        if self.inner is not None:
            self.inner.finish(timeout)
            self._count_branches(self.inner)

    def close(self) -> None:
        self.finish()

    # ---- measuring and re-planning --------------------------------------------------------------------------
    def _record(self, verdict: Verdict, tokens: int) -> None:
        now = time.perf_counter()
        self._step += 1
        self._recent.append((now - self._last, tokens))
        self._last = now
        self.generated += tokens
        self.online.record(verdict, self.strategy, self._reused)
        if self._probing and self.strategy.mode in TARGET_ONLY and self._pending is None:
            self._ar_steps += 1
            self._probe_due = self._ar_steps % PROBE_STEPS == 0
        if len(self._recent) < RECHECK_STEPS:
            return
        seconds = sum(s for s, _ in self._recent)
        measured = sum(t for _, t in self._recent) / seconds if seconds > 0 else float("inf")
        self._correct(seconds / len(self._recent))
        self._recent = []
        now = self.replay.all_counts()
        recent = tuple(c.since(b) for c, b in zip(now, self._replayed_at_check))  # (): the first check
        self._replayed_at_check = now
        expected = self.current.tokens_per_second * self.scale
        if measured >= (1.0 - SLACK) * expected:
            self._take_lookup(measured, recent)
            return
        self._replan(measured, expected, recent)

    def _replan(self, measured: float, expected: float, recent: tuple[LookupCounts, ...] = ()) -> None:
        """The running strategy measured ``measured`` tok/s, more than SLACK below the ``expected``: rank again with
        what this generation measured. From a strategy that runs the draft, ngram is ranked on the replay since the
        previous check only (none at the first check), as in _take_lookup: an answer's opening often restates its
        prompt, and a re-plan that read it left an sd measured at 23.6 tok/s for an ngram predicted 1.6 % faster
        that ran at 20.8 (a 2-core AVX2 EPYC; lab-notes/performance-log.md, 2026-12-07)."""
        acceptance = self.acceptance()
        if self.strategy.mode in DRAFTED:
            acceptance = replace(acceptance, lookup=recent)
        table = self._plan(acceptance, self.strategy)
        best = table.best
        running = next((r for r in table.rows if r.strategy == self.strategy), None)
        if running is not None and best.tokens_per_second < (1 + REPLAN_MARGIN) * running.tokens_per_second:
            # the same choice, or one the model cannot tell from it: its corrected prediction is what it measured
            self.scale = measured / max(running.tokens_per_second, 1e-9)
            self.table = table
            self.current = running
            return
        self.switches.append(Switch(self._step, self.strategy.name, best.strategy.name, round(measured, 2),
                                    round(expected, 2), f"measured {measured:.1f} tok/s < {1 - SLACK:.0%} of "
                                                        f"{expected:.1f} predicted; re-planned: " + why(table)))
        self.table = table
        self._pending = best

    def _correct(self, measured_step_s: float) -> None:
        """The running strategy's step time as measured: its factor on the profile's prediction (uncorrected)."""
        profiled = self._profiled(self.table.acceptance, self.strategy)
        predicted = next((r.step_s for r in profiled.rows if r.strategy == self.strategy), 0.0)
        if measured_step_s > 0 and predicted > 0:  # only ever dearer: see the module docstring
            self.step_factor[self.strategy] = max(1.0, measured_step_s / predicted)

    def acceptance(self) -> Acceptance:
        """What this generation measured so far (online.acceptance), with its ngram replay. While it runs a stop,
        it measures no alpha (online.record): plain sd's alpha is then the prior's, tempered by the shortfall its
        stops measured against the prior's (tempered_alpha), as the stops it cannot measure are (stops.prefer)."""
        known, stops = self.online.acceptance(self.prior), self.stops.counts()
        if self.online.steps < MIN_ONLINE_STEPS:
            factor = shortfall(stops, self.prior.stops)
            known = replace(known, alpha=tempered_alpha(known.alpha, factor, max(self.strategy.gamma, 1)))
        return replace(known, lookup=self.replay.all_counts(), stops=prefer(stops, self.prior.stops))

    def _take_lookup(self, measured: float, recent: tuple[LookupCounts, ...] = ()) -> None:
        """Switch to ngram when its replay on this text predicts it LOOKUP_MARGIN faster than what runs now (both
        predicted from the same acceptance and costs). ``recent``: the replay since the previous check (() at the
        first), which alone counts when leaving a draft (module docstring)."""
        if self.strategy.mode == "ngram" or self._pending is not None or self._probe_due:
            return  # a due ar probe decides first (its table ranks ngram too)
        acceptance = self.acceptance()
        if self.strategy.mode in DRAFTED:
            acceptance = replace(acceptance, lookup=recent)
        probed = self.probe.total.alpha if self._probing else None
        if probed is not None and acceptance.source != "online":  # in ar: what the probes measured of the draft
            acceptance = replace(acceptance, alpha=probed, source="ar probe")
        table = self._plan(acceptance, self.strategy)
        best = table.best_of("ngram")
        now = next((r for r in table.rows if r.strategy == self.strategy), None)
        if best is None or best is not table.best or now is None or \
                best.tokens_per_second < (1 + self._lookup_margin()) * now.tokens_per_second:
            return
        counts = table.acceptance.lookup_at(best.strategy.gamma)
        self.switches.append(Switch(self._step, self.strategy.name, best.strategy.name, round(measured, 2),
                                    round(best.tokens_per_second, 2),
                                    f"lookup replay: ngram would have committed {counts.tokens} tokens in "
                                    f"{counts.steps} steps; re-planned: " + why(table)))
        self.table = table
        self._pending = best

    def _lookup_margin(self) -> float:
        return LOOKUP_MARGIN_FROM_AR if self.strategy.mode == "ar" else LOOKUP_MARGIN

    def _probe(self, committed: list[int]) -> None:
        """In ar: probe the draft on the committed text and switch to speculation when it is predicted to pay."""
        self._probe_due = False
        if not speculation_can_pay(lambda a: self._plan(a, self.strategy), self.prior):
            return  # too few tokens left for a switch (and its draft prefill) to pay even with a perfect draft
        self.probe.probe(committed)
        alpha = self.probe.stats.alpha
        if alpha is None:
            return
        known = self.online.acceptance(self.prior)  # the probe measures alpha only; reuse stays what was known
        acceptance = Acceptance(alpha, known.reuse, known.reuse_noexit, "ar probe", self.replay.all_counts(),
                                prefer(self.stops.counts(), self.prior.stops))
        table = self._plan(acceptance, self.strategy)
        best = leave_ar(table, current=self.strategy)
        if best is None:
            return
        stats = self.probe.stats
        now = next(r for r in table.rows if r.strategy == self.strategy).tokens_per_second
        self.switches.append(Switch(self._step, self.strategy.name, best.strategy.name, round(now * self.scale, 2),
                                    round(best.tokens_per_second, 2),
                                    f"ar probe: the draft matched {stats.matches} of {stats.rows} generated tokens; "
                                    f"re-planned: " + why(table)))
        self.table = table
        self._pending = best

    def switch_to(self, strategy: Strategy) -> None:
        """Run ``strategy`` from the next step on (the re-planner's move; tests drive it directly)."""
        self._pending = Prediction(strategy, self.current.step_s, self.current.tokens_per_step)

    def _switch(self, committed: list[int]) -> None:
        """Finish the current proposer and start the new one from the committed text."""
        new, self._pending = self._pending, None
        if new.strategy != self.strategy or self.inner is None:
            self.inner.finish()
            self._count_branches(self.inner)
            self.inner = self._start(new.strategy)
            self.inner.reset(list(committed), self.sampler)
            if new.strategy.mode in TARGET_ONLY and self.strategy.mode not in TARGET_ONLY and self._probing:
                self.probe.restart()  # a new period without the draft: probe afresh, PROBE_STEPS from now
                self._ar_steps = 0  # (ar <-> ngram stays one period: the draft stayed idle)
        self.current = new
        self.scale = 1.0
        self._recent = []
        self._last = time.perf_counter()

    def _start(self, strategy: Strategy):
        """The proposer of ``strategy``; an sd one hands every window to the stop replay."""
        inner = self._make(strategy)
        if strategy.mode == "sd" and not strategy.streaming and hasattr(inner, "record_stops"):
            inner.record_stops(self.stops)
        return inner

    def _count_branches(self, proposer) -> None:
        counters = getattr(proposer, "counters", None)
        if counters is not None and hasattr(counters, "branches"):
            self.branches += counters.branches
            counters.branches = 0

    def measured_acceptance(self) -> Acceptance:
        """What this generation measured, for the next one's prior: its speculative steps' acceptance, else (it
        stayed in ar) the alpha its ar probes measured; the prior where it measured neither."""
        online = replace(self.online.acceptance(self.prior), stops=self.stops.counts())  # (blend adds them up)
        alpha = self.probe.total.alpha if self._probing else None
        if online.source == "online" or alpha is None:
            return online
        return Acceptance(alpha, self.prior.reuse, self.prior.reuse_noexit, "online", stops=online.stops)

    def report(self) -> dict:
        """What it chose and why, for the statistics and --json."""
        return {"chosen": self.first.strategy.name, "predicted_tokens_per_second": round(
                    self.first.tokens_per_second, 2),
                "why": why(self.first_table),
                "final": self.strategy.name, "switches": [s.__dict__ for s in self.switches],
                "online_acceptance": {"steps": self.online.steps,
                                      "alpha": round(self.online.accepted / self.online.tried, 4)
                                      if self.online.tried else None},
                "split": self.costs.split, "table": self.first_table.to_dict(),
                "ar_probe": self.probe.total.to_dict() if self._probing else None}
