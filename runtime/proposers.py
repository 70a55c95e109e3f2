"""Proposers: where a step's draft window comes from.

    none  (ar)     no window; the target decodes one token per step
    sd             the draft rolls out g tokens after the verdict, serially with the target
    mirror         see mirror.py: windows come from branches rolled out while the target verifies

Every proposer has the same four methods, so that the decode loop is written once; every window comes from the
rollout engine (rollout.py), with lookahead when the draft is a streaming one.
"""
from __future__ import annotations

from typing import Protocol

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.rollout import Window, fresh
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import Verdict


class Proposer(Protocol):
    mode: str

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None: ...

    def propose(self, committed: list[int], gamma: int) -> Window: ...

    def exit_callback(self):  # the early-exit hand-off, or None when the proposer does not use it
        ...

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None: ...

    def finish(self, timeout: float | None = None) -> None: ...


class TargetOnly:
    """No draft: the decode loop runs one target token per step (autoregressive decoding)."""

    mode = "ar"

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        pass

    def propose(self, committed: list[int], gamma: int) -> Window:
        return Window.empty()

    def exit_callback(self):
        return None

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        pass

    def finish(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class SerialDraft(TargetOnly):
    """Vanilla speculative decoding: after each verdict the draft rolls out the next window, then the target.
    ``lookahead``: the draft is a streaming one (runtime/streaming.py); the same windows in fewer forwards.
    ``lookup``: a prompt-lookup index (runtime/ngram.py) whose continuation the draft checks as lookahead in its
    first forward: again the same windows, in fewer forwards where the text repeats.
    ``confidence``: a window ends after its first pick below this draft probability (rollout.py); None = gamma
    picks always, 0 = gamma picks, their probabilities recorded (Window.confidence).
    ``record_stops(replay)``: every window and its verdict go to a planner/stops.StopReplay as well (mode auto,
    the calibration): what other stops would have done on the same steps."""

    mode = "sd"

    def __init__(self, draft: DraftModel, lookahead: bool = False, lookup=None, confidence: float | None = None
                 ) -> None:
        self.draft, self.lookahead, self.lookup, self.confidence = draft, lookahead, lookup, confidence
        self.sampler = GREEDY
        self.stops = None  # a StopReplay that records every window (record_stops)
        self._window: tuple[Window, int] | None = None  # the last window and the gamma it was asked for

    def record_stops(self, replay) -> None:
        self.stops = replay
        if self.confidence is None:
            self.confidence = 0.0  # record the picks' probabilities, stop nowhere

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        if not self.draft.keep_prefix(prompt):  # what the last text shares with this one is not read again
            self.draft.reset(capacity=len(prompt) + 64)
        self.sampler = sampler
        if self.lookup is not None:
            self.lookup.sync(prompt)

    def propose(self, committed: list[int], gamma: int) -> Window:
        guess = None
        if self.lookup is not None:
            self.lookup.sync(committed)
            guess = self.lookup.lookup(gamma - 1)  # the last window token is picked, never fed
        try:
            window = fresh(self.draft, committed, gamma, self.sampler, lookahead=self.lookahead, guess=guess,
                           confidence=self.confidence)
        except Exception as exc:  # as in mirror: a draft failure is a DraftWorkerError, which on_draft_failure handles
            raise DraftWorkerError("The draft model failed", f"{type(exc).__name__}: {exc}",
                                   "see the chained exception; the target itself is unaffected") from exc
        self._window = (window, gamma)
        return window

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        if self.stops is not None and self._window is not None and self._window[0].confidence is not None:
            window, gamma = self._window
            self.stops.record(window.confidence, verdict.accepted, gamma, self.confidence or 0.0)
        self._window = None
