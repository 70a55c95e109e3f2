"""The latency model checked against a bench run: for each of mirrorsd's fixed modes, the decode speed the model
predicts from the profile's costs and the acceptance *that run measured*, next to the speed it ran at.

Auto ranks strategies by these predictions (runtime/planner/latency.py), so this table says how far its ranking can
be trusted on this machine. Only the acceptance comes from the run (per prompt: sd and mirror's alpha from their
mean accepted tokens, mirror's reuse rate, ngram's copied windows); every cost comes from the profile, measured
before the run. Mode ngram's replay widths are not in a run's statistics, so its windows are priced at their mean
width (the verify cost interpolated between the two row counts around it); so are sd-stop's (sd with a
draft-confidence stop, whose windows vary in length; with or without n-gram lookahead), plus the run's draft
forwards; so is mode auto's mix of those strategies (a run of auto that took Mirror-SD is not priced). sd's start-up
(the draft's prefill of the prompt, in its first step) is spread over the run's steps as mode auto spreads it
(latency.startup_s): on a 20-token answer it is a large share of the decode time, and a check without it put sd
13-22 % under its prediction on 2026-12-03 where the per-step costs were right within 5 %.
"""
from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.runtime.planner.latency import (Acceptance, SplitCosts, Strategy, alpha_from_mean_accepted,
                                              predict)

CHECKED = {"ar": ("ar", True), "sd": ("sd", True), "mirror": ("mirror", True), "mirror-noexit": ("mirror", False),
           "ngram": ("ngram", True), "sd-stop": ("sd-stop", True), "sd-stop-ngram": ("sd-stop", True),
           "auto": ("auto", True)}  # bench mode -> (latency-model mode, exit head)


@dataclass(frozen=True)
class CheckRow:
    mode: str
    prompts: int
    predicted: float  # mean over prompts of the predicted decode tokens/s
    measured: float  # mean over prompts of the measured decode tokens/s
    split: str = ""  # the split whose costs priced it, when not the table's (mode auto on its own pipeline)

    @property
    def error(self) -> float:
        """measured / predicted - 1: positive when the mode ran faster than predicted."""
        return self.measured / self.predicted - 1.0 if self.predicted > 0 else float("inf")


def predicted_tps(costs: SplitCosts, mode: str, stats: dict, gamma: int) -> float | None:
    """Decode tokens/s the latency model predicts for one bench run of ``mode`` (a key of CHECKED), from ``costs``
    and the acceptance in the run's ``stats`` (GenerationStats.to_dict()); None when the run took no step."""
    kind, exit_head = CHECKED[mode]
    steps = stats.get("steps", 0)
    if not steps:
        return None
    if kind == "ar":
        return 1.0 / costs.verify_s[0]
    if kind == "ngram":
        return _windows_tps(costs, stats)
    if kind == "sd-stop":
        return _windows_tps(costs, stats, costs.draft1_s, costs.draft_prefill_s * stats.get("prompt_tokens", 0))
    if kind == "auto":
        return _auto_tps(costs, stats)
    g = min(gamma, costs.max_gamma)
    alpha = alpha_from_mean_accepted(stats["mean_accepted_tokens"], g)
    reuse = stats.get("reuse_rate", 0.0)
    strategy = Strategy(kind, g, exit_head=exit_head, streaming=bool(costs.stream_window_s))
    return predict(costs, strategy, Acceptance(alpha, reuse, reuse, "bench run"), context=stats.get("prompt_tokens", 0),
                   new_tokens=stats.get("new_tokens", 0)).tokens_per_second


def _auto_tps(costs: SplitCosts, stats: dict) -> float | None:
    """Mode auto priced like sd-stop: its steps whatever strategy took them (ar, sd with or without a stop, ngram),
    with the run's draft forwards and, when it drafted, the draft's prefill. None when it ran Mirror-SD (whose
    steps overlap two models and are not priced by windows) or on another split than ``costs``."""
    report = stats.get("auto") or {}
    used = [report.get("chosen", ""), report.get("final", "")] + [s.get("new", "") for s in report.get("switches", [])]
    if any(name.startswith("mirror") for name in used) or report.get("split", costs.split) != costs.split:
        return None
    prefill = costs.draft_prefill_s * stats.get("prompt_tokens", 0) if stats.get("draft_forwards", 0) else 0.0
    return _windows_tps(costs, stats, costs.draft1_s, prefill)


def _windows_tps(costs: SplitCosts, stats: dict, draft_s: float = 0.0, startup_s: float = 0.0) -> float:
    """Windows priced at their mean width; ``draft_s`` per draft forward (0: copied, mode ngram), ``startup_s``
    once (the draft's prefill)."""
    steps, windows, drafted = stats["steps"], stats["windows"], stats["drafted"]
    tokens = stats["accepted"] + steps
    width = drafted / windows if windows else 0.0  # copied tokens per window, on average
    low = min(int(width), costs.max_gamma)
    high = min(low + 1, costs.max_gamma)
    verify_window = costs.verify_s[low] + (width - low) * (costs.verify_s[high] - costs.verify_s[low])
    seconds = (steps - windows) * costs.verify_s[0] + windows * verify_window + stats.get("draft_forwards", drafted) * draft_s + \
        startup_s
    return tokens / seconds


def check(costs: SplitCosts, runs: list, gamma: int, auto_costs: SplitCosts | None = None) -> list[CheckRow]:
    """One row per checked mode present in ``runs`` (bench PromptRun objects); mode auto priced with
    ``auto_costs``, the split it ran on, when given."""
    rows = []
    for mode in CHECKED:
        here = auto_costs if mode == "auto" and auto_costs is not None else costs
        pairs = [(predicted_tps(here, mode, r.stats, gamma), r.stats["decode_tokens_per_second"])
                 for r in runs if r.mode == mode]
        pairs = [(p, m) for p, m in pairs if p is not None]
        if pairs:
            rows.append(CheckRow(mode, len(pairs), sum(p for p, _ in pairs) / len(pairs),
                                 sum(m for _, m in pairs) / len(pairs), "" if here is costs else here.split))
    return rows


def markdown_lines(rows: list[CheckRow], split: str, limit: float = 0.15) -> list[str]:
    if not rows:
        return []
    lines = ["", f"Latency model vs this run (profile costs of the {split} split, each run's own acceptance; "
                 f"the model's goal: within {limit:.0%}):", "",
             "| mode | prompts | predicted decode tok/s | measured decode tok/s | error |", "|---|---|---|---|---|"]
    for row in rows:
        flag = "" if abs(row.error) <= limit else " (outside)"
        name = f"{row.mode} ({row.split})" if row.split else row.mode
        lines.append(f"| {name} | {row.prompts} | {row.predicted:.2f} | {row.measured:.2f} | "
                     f"{row.error:+.0%}{flag} |")
    return lines
