"""While mode auto runs ar (or ngram: neither uses the draft), measure whether the draft would be accepted now,
without touching the target's output.

    probe     every PROBE_STEPS ar steps, the draft reads the tokens committed since its last probe (one forward
              over all of them, on its own KV cache; the first probe of a generation prefills the whole text) and
              its argmax at each position is compared with the token the target committed next. Under greedy
              verification a draft token is accepted exactly when it equals the target's token given the committed
              text, so matches / rows is the per-token acceptance alpha a speculative step would see now
    decide    leave_ar: the re-planner ranks again with that alpha; it leaves ar (or ngram) only when another
              strategy is predicted LEAVE_MARGIN faster than the one running (hysteresis: it entered ar or ngram
              because speculation with the draft measured slower)
    exact     the target never sees the probe (it decodes one token per step as before); the draft's cache is the
              only state it changes, and every speculative proposer rebuilds or re-syncs that cache itself

Only for greedy decoding without a repetition penalty (Sampler.plain): under sampling the acceptance is another
quantity. Rows are scored only on generated tokens (the prompt is another text than the answer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from mirrorsd.runtime.planner.latency import ALPHA_CAP, Acceptance, Strategy, Table

PROBE_STEPS = 32  # ar steps between probes: one batched draft forward per 32 target steps
MIN_PROBE_ROWS = 16  # scored positions before the probe's alpha replaces what was known
LEAVE_MARGIN = 0.10  # leave ar only for a strategy predicted more than 10 % faster (no flapping on noise)


@dataclass
class ProbeStats:
    probes: int = 0  # draft forwards run by the probe
    rows: int = 0  # generated positions scored (draft argmax vs the target's token)
    matches: int = 0
    seconds: float = 0.0

    @property
    def alpha(self) -> float | None:
        return self.matches / self.rows if self.rows >= MIN_PROBE_ROWS else None

    def to_dict(self) -> dict:
        return {"probes": self.probes, "rows": self.rows, "matches": self.matches,
                "alpha": None if self.alpha is None else round(self.alpha, 4), "seconds": round(self.seconds, 4)}


class ArProbe:
    """Teacher-forced draft predictions on the text ar commits (see the module docstring)."""

    def __init__(self, draft) -> None:
        self.draft = draft  # a DraftModel: extend / sync_to / reset
        self.stats = ProbeStats()  # this ar period's
        self.total = ProbeStats()  # the generation's
        self._generated_from = 0  # committed[i] for i >= this is generated text (scored)
        self._pending: tuple[int, int] | None = None  # (position, the draft's prediction there), not yet committed
        self._fresh = True

    def start(self, prompt_tokens: int) -> None:
        """A new generation: the draft's cache belongs to another text; scores start afresh."""
        self._generated_from = prompt_tokens
        self._fresh = True
        self.total = ProbeStats()
        self.restart()

    def restart(self) -> None:
        """A new ar period: what the probe measured before (in another period) no longer counts."""
        self.stats = ProbeStats()
        self._pending = None

    def probe(self, committed: list[int]) -> None:
        start = time.perf_counter()
        if self._fresh:
            self.draft.reset(capacity=len(committed) + 64)
            self._fresh = False
        feed = self.draft.sync_to(committed)
        if not feed:
            return
        first = len(committed) - len(feed)  # the position of feed[0]
        logits = self.draft.extend(list(feed))  # row i predicts the token at first + i + 1
        predicted = np.asarray(logits).argmax(-1)
        if self._pending is not None and self._pending[0] == first:
            self._score(first, self._pending[1], committed)
        for i in range(len(feed) - 1):
            self._score(first + i + 1, int(predicted[i]), committed)
        self._pending = (len(committed), int(predicted[-1]))
        for stats in (self.stats, self.total):
            stats.probes += 1
            stats.seconds += time.perf_counter() - start

    def _score(self, position: int, token: int, committed: list[int]) -> None:
        if position >= self._generated_from:
            for stats in (self.stats, self.total):
                stats.rows += 1
                stats.matches += int(committed[position] == token)


def speculation_can_pay(table_for, acceptance: Acceptance) -> bool:
    """Whether leaving ar could pay even with a perfect draft (``table_for(acceptance) -> Table``, which prices what
    a switch costs now: the draft's prefill of the text, spread over the tokens still to come). If not, a probe
    cannot change the choice and its draft forwards (the first one a prefill of the whole text) are wasted."""
    perfect = replace(acceptance, alpha=ALPHA_CAP, reuse=1.0, reuse_noexit=1.0)
    return leave_ar(table_for(perfect)) is not None


def leave_ar(table: Table, margin: float = LEAVE_MARGIN, current: Strategy | None = None):
    """The strategy to switch to from ar (or from ``current``, a strategy without a draft: ar or ngram), or None:
    the fastest row of ``table`` of another mode than ar and ``current``'s, when it is predicted more than
    ``margin`` faster than ``current`` (ar when not given)."""
    base = next((r for r in table.rows if r.strategy == current), None) if current else table.best_of("ar")
    mode = base.strategy.mode if base is not None else "ar"
    other = next((r for r in table.rows if r.strategy.mode not in ("ar", mode)), None)
    if base is None or other is None or other.tokens_per_second <= (1 + margin) * base.tokens_per_second:
        return None
    return other
