"""Mode auto's thread split: which intra-op thread counts the target's and the draft's sessions get at load time.

A session's thread count is fixed when it opens, so this is decided once per loaded pipeline, before any
generation, from the cached profile of the export and its placement (mirrorsd/profile.py):

    candidates  every thread split the profile holds (``mirrorsd devices --profile`` measures every core per
                session and one per session; a generation adds its own split)
    rank        the latency model's fastest strategy on each split, with the profile's acceptance
    choose      the split whose best strategy is fastest; the split the pipeline already runs is kept unless
                another one is predicted more than KEEP_MARGIN faster (a reload for a difference inside the
                profile's noise would buy nothing)

Explicit thread counts (``--threads``, DeviceRequest.target_threads / draft_threads) always win; without a cached
profile (or without its acceptance) the default stays: every core per session (devices/backends.default_threads).
Pure: a Profile and numbers in, a ThreadChoice out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mirrorsd.runtime.latency import Acceptance, rank

KEEP_MARGIN = 0.05  # switch splits only when another is predicted more than 5 % faster (profile noise ~ +-5-10 %)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads of (target, draft) sessions and why; ``source`` is "given", "profile" or "default"."""

    threads: tuple[int, int]
    source: str
    why: str
    candidates: dict = field(default_factory=dict)  # split -> {"best": strategy name, "tokens_per_second": x}

    @property
    def split(self) -> str:
        return f"{self.threads[0]}+{self.threads[1]}"

    def to_dict(self) -> dict:
        return {"chosen": self.split, "source": self.source, "why": self.why, "candidates": self.candidates}


def given(threads: tuple[int, int]) -> ThreadChoice:
    return ThreadChoice(threads, "given", f"{threads[0]}+{threads[1]} threads asked for explicitly")


def default(threads: tuple[int, int], reason: str) -> ThreadChoice:
    return ThreadChoice(threads, "default", f"every core per session (the default): {reason}")


def choose_split(profile, acceptance: Acceptance | None, current: tuple[int, int]) -> ThreadChoice:
    """The thread split to run from ``profile``'s measured splits (see the module docstring); ``current`` is the
    split the pipeline was opened with (the default)."""
    splits = [s for s in profile.splits if not s.name]  # named splits are hand-written placements, not threads
    if acceptance is None:
        return default(current, "the cached profile has no acceptance statistics yet")
    if not splits:
        return default(current, "the cached profile holds no thread split")
    table = rank(splits, acceptance)
    best: dict[str, object] = {}
    for row in table.rows:  # fastest first: the first row of a split is its best strategy
        best.setdefault(row.strategy.split, row)
    candidates = {name: {"best": row.strategy.name, "tokens_per_second": round(row.tokens_per_second, 2)}
                  for name, row in best.items()}
    winner = table.best
    chosen = next(s for s in splits if s.split == winner.strategy.split)
    here = best.get(f"{current[0]}+{current[1]}")
    a = acceptance
    basis = f"alpha {a.alpha:.2f}, reuse {a.reuse:.2f} ({a.source})"
    if here is not None and winner.tokens_per_second <= (1 + KEEP_MARGIN) * here.tokens_per_second:
        return ThreadChoice(current, "profile", f"{current[0]}+{current[1]} kept: {here.strategy.name} predicted "
                            f"{here.tokens_per_second:.1f} tok/s, within {KEEP_MARGIN:.0%} of the best split "
                            f"({winner.strategy.name} {winner.tokens_per_second:.1f}; {basis})", candidates)
    others = ", ".join(f"{k}: {v['best']} {v['tokens_per_second']:.1f}" for k, v in candidates.items()
                       if k != chosen.split)
    return ThreadChoice((chosen.target_threads, chosen.draft_threads), "profile",
                        f"{chosen.split}: {winner.strategy.name} predicted {winner.tokens_per_second:.1f} tok/s "
                        f"(other splits: {others or 'none'}; {basis})", candidates)
