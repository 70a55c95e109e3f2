"""Mode auto's placement: which device runs the target and which the draft, decided at load time from measured
profiles, together with the thread split (runtime/planner/threads.py).

    candidates  every (target, draft) device pair the request allows here (devices/placement.placement_candidates:
                for a model left on ``auto``, each device of its chain that works here, including the ones the
                chain does not take by default, e.g. OpenVINO's CPU plugin); the chain's own pick comes first
    profiles    the cached profile of each pair (``mirrorsd devices --profile --model EXPORT`` measures every
                pair); a pair without one is listed as not measured and not ranked
    choose      each pair's best thread split (auto_threads.choose_split; only the splits the request allows:
                the given threads, the given pool kind), then the pair whose best strategy is predicted
                fastest. The chain's pick is kept unless another pair is predicted more than KEEP_MARGIN faster
                (a reload for a difference inside the profile's noise buys nothing), and when the chain's pick
                has no profile nothing is compared

Every pair is ranked with one acceptance, the chain's pick's calibration (each pair's own where it has none): the
two models are the same wherever they run, so only the costs may differ between pairs, not the acceptance noise of
separate calibrations. Pure: profiles and numbers in, a PlacementChoice out.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from mirrorsd.runtime.planner import threads as auto_threads
from mirrorsd.runtime.planner.threads import KEEP_MARGIN, SplitRule, ThreadChoice


@dataclass(frozen=True)
class PlacementChoice:
    """The (target, draft) devices and the thread split to run, and why; ``source`` is "profile" or "default"."""

    devices: tuple[str, str]
    threads: ThreadChoice
    source: str
    why: str
    candidates: dict = field(default_factory=dict)  # "target+draft" -> best strategy, split and tok/s, or why not

    @property
    def name(self) -> str:
        return pair_name(self.devices)

    def to_dict(self) -> dict:
        return {"chosen": self.name, "source": self.source, "why": self.why, "candidates": self.candidates}


def pair_name(devices: tuple[str, str]) -> str:
    return f"{devices[0]}+{devices[1]}"


def default(devices: tuple[str, str], threads: ThreadChoice, reason: str) -> PlacementChoice:
    return PlacementChoice(devices, threads, "default", f"{pair_name(devices)} (the auto chains' pick): {reason}")


def ranking_acceptance(profiles: dict, chain_pick: tuple[str, str]):
    """The acceptance every placement is ranked with: the chain pick's calibration (None: each pair's own)."""
    here = profiles.get(chain_pick)
    return here.acceptance if here is not None else None


def choose_placement(profiles: dict, chain_pick: tuple[str, str], current: tuple[int, int, bool],
                     rule: SplitRule = SplitRule()) -> PlacementChoice:
    """The placement and thread split to run (see the module docstring). ``profiles``: (target device, draft
    device) -> its cached Profile or None; ``chain_pick``: the pair the auto chains chose (opened already, with
    ``current`` = (target threads, draft threads, shared pool)); ``rule``: the splits the request allows (given
    threads: only that split is compared)."""
    prior = ranking_acceptance(profiles, chain_pick)
    best: dict = {}  # pair -> (tok/s, ThreadChoice, strategy name)
    candidates: dict = {}
    threads, shared = current[:2], current[2]
    for pair, profile in profiles.items():
        ranked = _best_on(profile, prior, current, rule)
        if isinstance(ranked, str):
            candidates[pair_name(pair)] = {"not ranked": ranked}
            continue
        best[pair] = ranked
        tok_s, choice, strategy = ranked
        candidates[pair_name(pair)] = {"best": strategy, "split": choice.split, "tokens_per_second": round(tok_s, 2)}
    fallback = auto_threads.given(threads, shared) if rule.given else auto_threads.default(
        threads, "no cached profile of this export and placement (`mirrorsd devices --profile --model EXPORT` "
                 "measures one)", shared)
    if chain_pick not in best:
        reason = candidates.get(pair_name(chain_pick), {}).get("not ranked", "no cached profile")
        choice = default(chain_pick, fallback, f"nothing to compare it with ({reason})")
        return PlacementChoice(choice.devices, choice.threads, choice.source, choice.why, candidates)
    winner = max(best, key=lambda pair: best[pair][0])
    kept = best[chain_pick]
    if winner == chain_pick or best[winner][0] <= (1 + KEEP_MARGIN) * kept[0]:
        others = _others(best, chain_pick)
        return PlacementChoice(chain_pick, kept[1], "profile",
                               f"{pair_name(chain_pick)} kept: {kept[2]} on {kept[1].split} threads predicted "
                               f"{kept[0]:.1f} tok/s (other placements: {others or 'none measured'}; another one "
                               f"must be predicted more than {KEEP_MARGIN:.0%} faster)", candidates)
    tok_s, choice, strategy = best[winner]
    return PlacementChoice(winner, choice, "profile",
                           f"{pair_name(winner)}: {strategy} on {choice.split} threads predicted {tok_s:.1f} tok/s, "
                           f"{tok_s / kept[0]:.2f}x the auto chains' pick {pair_name(chain_pick)} ({kept[2]} "
                           f"{kept[0]:.1f})", candidates)


def _best_on(profile, prior, current: tuple[int, int, bool], rule: SplitRule):
    """(predicted tok/s, ThreadChoice, strategy) of ``profile``'s best split that ``rule`` allows, or why it
    cannot be ranked."""
    if profile is None:
        return "no cached profile (`mirrorsd devices --profile --model EXPORT` measures every placement)"
    acceptance = prior or profile.acceptance
    if acceptance is None:
        return "its profile has no acceptance statistics yet"
    choice = auto_threads.choose_split(profile, acceptance, current, rule)
    if choice.source != "profile":
        return choice.why
    if rule.given:  # the threads were asked for; the profile chose only the pool
        choice = replace(choice, source="given")
    row = choice.candidates.get(choice.split)
    return row["tokens_per_second"], choice, row["best"]


def _others(best: dict, chain_pick: tuple[str, str]) -> str:
    return ", ".join(f"{pair_name(p)}: {s} {t:.1f}" for p, (t, _, s) in best.items() if p != chain_pick)
