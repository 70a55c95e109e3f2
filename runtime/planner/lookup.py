"""What mode ngram would have done on a text: the planner's measure of prompt lookup.

Decoding is lossless, so the text a generation commits is the target's whatever the mode; replaying mode ngram's
steps on it gives ngram's exact step sequence (greedy) without running it:

    at position i   the lookup (runtime/ngram.py) on text[:i] proposes up to g tokens; m = how many of them the text
                    continues with; the step verifies 1 + len(proposal) rows and commits m + 1 tokens (no proposal:
                    one row, one token, as ar)

``LookupReplay`` replays every window length g = 1 .. max_gamma side by side as the text grows (one lookup per committed
token) and counts, per g, the tokens committed and the steps at each verification width. The latency
model (latency.py) turns those counts into tokens/s with the profile's verify(w) costs.
"""
from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.runtime.ngram import NgramIndex, NgramSettings


@dataclass(frozen=True)
class LookupCounts:
    """Replayed mode ngram at one window length: tokens committed, and steps by verification rows (widths[w - 1]
    = steps that verified w rows)."""

    tokens: int
    widths: tuple[int, ...]

    @property
    def steps(self) -> int:
        return sum(self.widths)

    def since(self, earlier: "LookupCounts | None") -> "LookupCounts":
        """What was replayed after ``earlier`` (an earlier count of the same replay; None: from the start)."""
        if earlier is None:
            return self
        return LookupCounts(self.tokens - earlier.tokens,
                            tuple(a - b for a, b in zip(self.widths, earlier.widths)))

    @property
    def windows(self) -> int:
        """Steps that verified a copied window (more than one row)."""
        return self.steps - (self.widths[0] if self.widths else 0)


class LookupReplay:
    """Replays mode ngram at every window length 1 .. max_gamma on a growing text."""

    def __init__(self, max_gamma: int, settings: NgramSettings = NgramSettings()) -> None:
        self.max_gamma = max_gamma
        self.index = NgramIndex(settings)
        self._start = 0  # the first position a step decodes (after the prompt and the prefill's token)
        self._next = [0] * max_gamma  # per g: the position of its next step
        self._tokens = [0] * max_gamma
        self._widths = [[0] * (g + 1) for g in range(1, max_gamma + 1)]
        self._pending: dict[int, list[int]] = {}  # position -> its lookup of max_gamma tokens (asked when reached)

    def start(self, prompt: list[int], first: int | None = None) -> None:
        """A generation after ``prompt`` (whose first new token is decoded by the prefill, outside any step)."""
        self.index.sync(list(prompt) + ([first] if first is not None else []))
        self._start = len(self.index.tokens)
        self._next = [self._start] * self.max_gamma
        self._pending = {}

    def follow(self, text: list[int]) -> None:
        """The committed text (it only grows): replay every step whose outcome the text now decides."""
        while len(self.index.tokens) < len(text):
            position = len(self.index.tokens)  # a step of some g may start here: ask the lookup on text[:position]
            self._pending[position] = self.index.lookup(self.max_gamma)
            self.index.extend(text[position:position + 1])
            self._settle(len(self.index.tokens))

    def _settle(self, known: int) -> None:
        text = self.index.tokens
        for g in range(1, self.max_gamma + 1):
            while True:
                at = self._next[g - 1]
                proposal = self._pending.get(at, [])[:g]
                if at >= known or at + len(proposal) >= known + (len(proposal) == 0):
                    break  # the text does not yet decide this step (the correction after the window included)
                matched = 0
                while matched < len(proposal) and proposal[matched] == text[at + matched]:
                    matched += 1
                self._widths[g - 1][len(proposal)] += 1
                self._tokens[g - 1] += matched + 1
                self._next[g - 1] = at + matched + 1
        low = min(self._next)
        for position in [p for p in self._pending if p < low]:
            del self._pending[position]

    def counts(self, gamma: int) -> LookupCounts:
        return LookupCounts(self._tokens[gamma - 1], tuple(self._widths[gamma - 1]))

    def all_counts(self) -> tuple[LookupCounts, ...]:
        """Per g = 1 .. max_gamma."""
        return tuple(self.counts(g) for g in range(1, self.max_gamma + 1))
