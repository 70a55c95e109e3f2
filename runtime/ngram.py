"""Prompt lookup: draft windows copied from earlier text, at no model cost.

Text that repeats (code that reuses names, an answer quoting its question, a list with a fixed shape) is predicted
well by its own past: find the last time the text ended the way it ends now, and propose what came next.

    index      for every n in [min_n, max_n]: n-gram -> where its most recent continuation starts
               (an n-gram is registered once a token follows it, so the text's own suffix never matches itself)
    lookup     the longest n whose suffix n-gram occurred before wins; its most recent occurrence gives the
               continuation. A continuation that runs into the suffix itself repeats with the match's period:
               "... a b c a b c" continues "a b c a ..." however long the window.

Two uses, both exact (the target verifies every proposed token as it verifies a draft's):

    mode ngram       the continuation is the draft window (no draft model at all; a step without a match decodes
                     one token, as ar does)
    sd with ngram    the continuation is fed to the draft as lookahead (rollout.py): the draft checks the guess in
                     one wider forward and keeps the prefix its own picks confirm, so the window is the draft's own
                     (the same tokens) in fewer forwards
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirrorsd.runtime.proposers import TargetOnly
from mirrorsd.runtime.rollout import Window
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import Verdict


@dataclass(frozen=True)
class NgramSettings:
    min_n: int = 2  # shortest suffix that may match (1 matches almost anything: its windows are mostly rejected)
    max_n: int = 4  # longest suffix tried first


class NgramIndex:
    """The n-grams of one growing text and where each was last continued. Pure Python; O(max_n - min_n) per token."""

    def __init__(self, settings: NgramSettings = NgramSettings()) -> None:
        self.settings = settings
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram (any n in range) -> start of its latest continuation

    def extend(self, tokens) -> None:
        lo, hi = self.settings.min_n, self.settings.max_n
        text, starts = self.tokens, self._starts
        for token in tokens:
            end = len(text)  # the n-grams ending here get a continuation now: the token appended below
            for n in range(lo, min(hi, end) + 1):
                starts[tuple(text[end - n:end])] = end
            text.append(int(token))

    def sync(self, text: list[int]) -> None:
        """Make the index hold ``text``: appended tokens are added; a text that is not a continuation of the held
        one (a rollback, another generation) is indexed afresh."""
        held = len(self.tokens)
        if len(text) >= held and (held == 0 or text[held - 1] == self.tokens[-1]) and text[:held] == self.tokens:
            self.extend(text[held:])
        else:
            self.tokens, self._starts = [], {}
            self.extend(text)

    def lookup(self, count: int) -> list[int]:
        """Up to ``count`` tokens continuing the text as it continued after the latest earlier occurrence of its
        longest matching suffix; [] when no suffix of min_n or more tokens occurred before."""
        text = self.tokens
        if count < 1:
            return []
        for n in range(min(self.settings.max_n, len(text)), self.settings.min_n - 1, -1):
            start = self._starts.get(tuple(text[len(text) - n:]))
            if start is not None:
                period = text[start:]  # [1, ...) tokens: repeated when the window runs past the text's end
                return [period[i % len(period)] for i in range(count)]
        return []


class NgramProposer(TargetOnly):
    """Mode ngram: each window is the lookup's continuation of the committed text. The decode loop verifies it with
    the target like a draft window; a step without a match proposes nothing (one target token, as in ar)."""

    mode = "ngram"

    def __init__(self, vocab_size: int, settings: NgramSettings = NgramSettings()) -> None:
        self.vocab_size, self.settings = vocab_size, settings
        self.index = NgramIndex(settings)
        self.sampler = GREEDY
        self.looked_up = self.matched = 0  # steps that asked for a window; steps that found one

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        self.index = NgramIndex(self.settings)
        self.index.extend(prompt)
        self.sampler = sampler
        self.looked_up = self.matched = 0

    def propose(self, committed: list[int], gamma: int) -> Window:
        self.index.sync(committed)
        guess = self.index.lookup(gamma)
        self.looked_up += 1
        if not guess:
            return Window.empty(target_only=True)
        self.matched += 1
        tokens = np.asarray(guess, np.int64)  # [g]
        probs = None
        if self.sampler.drafts_sample:  # the residual rule reads q: a copied token was "drawn" with certainty
            probs = np.zeros((len(guess), self.vocab_size), np.float32)  # [g, vocab]
            probs[np.arange(len(guess)), tokens] = 1.0
        return Window(tokens, np.zeros((len(guess), 0), np.int64), np.zeros((len(guess), 0), np.float32), probs)

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        pass  # the index catches up with the committed text at the next propose
