"""Mode auto's thread split: which intra-op thread counts the target's and the draft's sessions get at load time.

A session's thread count is fixed when it opens, so this is decided once per loaded pipeline, before any
generation, from the cached profile of the export and its placement (runtime/planner/profile.py):

    candidates  every thread split the profile holds that the pipeline may take (SplitRule): ``mirrorsd devices
                --profile`` measures every core per session, one per session, and every core on the process's
                shared pool ("2 shared", devices/thread_pool.py); a generation adds its own split
    rank        the latency model's fastest strategy on each split, with the profile's acceptance
    choose      the split whose best strategy is fastest; the split the pipeline already runs is kept unless
                another one is predicted more than KEEP_MARGIN faster (a reload for a difference inside the
                profile's noise would buy nothing)

Explicit thread counts (``--threads``, DeviceRequest.target_threads / draft_threads) and an explicit pool kind
(``--shared-pool`` / ``--no-shared-pool``) restrict the candidates; once the process holds a shared pool, only a
shared split of its size is (devices/thread_pool.py). Without a cached profile (or without its acceptance) the
default stays: every core per session (devices/backends.default_threads).
Pure: a Profile and numbers in, a ThreadChoice out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mirrorsd.runtime.planner.latency import Acceptance, rank, split_name

KEEP_MARGIN = 0.05  # switch splits only when another is predicted more than 5 % faster (no switching on noise)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads of (target, draft) sessions, whether they share the process's pool, and why; ``source`` is
    "given", "profile" or "default"."""

    threads: tuple[int, int]
    source: str
    why: str
    candidates: dict = field(default_factory=dict)  # split -> {"best": strategy name, "tokens_per_second": x}
    shared_pool: bool = False

    @property
    def split(self) -> str:
        return split_name(*self.key)

    @property
    def key(self) -> tuple[int, int, bool]:
        return (*self.threads, self.shared_pool)

    def to_dict(self) -> dict:
        return {"chosen": self.split, "source": self.source, "why": self.why, "candidates": self.candidates}


@dataclass(frozen=True)
class SplitRule:
    """Which of a profile's splits a pipeline may take: ``threads`` (None: any; else the given counts), ``shared``
    (None: either pool kind; True/False: only that one), and ``pool_size``, the process's shared pool when it has
    one already: then only a shared split of that size can open (ONNX Runtime sizes the pool once and refuses
    sessions with threads of their own beside it, devices/thread_pool.py)."""

    threads: tuple[int, int] | None = None
    shared: bool | None = None
    pool_size: int | None = None

    def allows(self, costs) -> bool:
        if self.threads is not None and (costs.target_threads, costs.draft_threads) != self.threads:
            return False
        if self.shared is not None and costs.shared_pool != self.shared:
            return False
        if self.pool_size is not None:
            return costs.shared_pool and costs.target_threads == costs.draft_threads == self.pool_size
        return True

    @property
    def given(self) -> bool:
        return self.threads is not None


def given(threads: tuple[int, int], shared_pool: bool = False) -> ThreadChoice:
    return ThreadChoice(threads, "given", f"{split_name(*threads, shared_pool)} threads asked for explicitly",
                        shared_pool=shared_pool)


def default(threads: tuple[int, int], reason: str, shared_pool: bool = False) -> ThreadChoice:
    return ThreadChoice(threads, "default", f"every core per session (the default): {reason}",
                        shared_pool=shared_pool)


def choose_split(profile, acceptance: Acceptance | None, current: tuple[int, int, bool],
                 rule: SplitRule = SplitRule()) -> ThreadChoice:
    """The thread split to run from ``profile``'s measured splits that ``rule`` allows (see the module docstring);
    ``current`` is the (target threads, draft threads, shared pool) the pipeline was opened with."""
    # named splits are hand-written placements, not threads
    splits = [s for s in profile.splits if not s.name and rule.allows(s)]
    here_threads, here_shared = current[:2], current[2]
    if acceptance is None:
        return default(here_threads, "the cached profile has no acceptance statistics yet", here_shared)
    if not splits:
        return default(here_threads, "the cached profile holds no thread split this pipeline can take", here_shared)
    table = rank(splits, acceptance)
    best: dict[str, object] = {}
    for row in table.rows:  # fastest first: the first row of a split is its best strategy
        best.setdefault(row.strategy.split, row)
    candidates = {name: {"best": row.strategy.name, "tokens_per_second": round(row.tokens_per_second, 2)}
                  for name, row in best.items()}
    winner = table.best
    chosen = next(s for s in splits if s.split == winner.strategy.split)
    here_name = split_name(*current)
    here = best.get(here_name)
    a = acceptance
    basis = f"alpha {a.alpha:.2f}, reuse {a.reuse:.2f} ({a.source})"
    if here is not None and winner.tokens_per_second <= (1 + KEEP_MARGIN) * here.tokens_per_second:
        return ThreadChoice(here_threads, "profile", f"{here_name} kept: {here.strategy.name} predicted "
                            f"{here.tokens_per_second:.1f} tok/s, within {KEEP_MARGIN:.0%} of the best split "
                            f"({winner.strategy.name} {winner.tokens_per_second:.1f}; {basis})", candidates,
                            here_shared)
    others = ", ".join(f"{k}: {v['best']} {v['tokens_per_second']:.1f}" for k, v in candidates.items()
                       if k != chosen.split)
    return ThreadChoice((chosen.target_threads, chosen.draft_threads), "profile",
                        f"{chosen.split}: {winner.strategy.name} predicted {winner.tokens_per_second:.1f} tok/s "
                        f"(other splits: {others or 'none'}; {basis})", candidates, chosen.shared_pool)
