"""Proposers: where a step's draft window comes from.

    none  (ar)     no window; the target decodes one token per step
    sd             the draft rolls out g tokens after the verdict, serially with the target
    mirror         see mirror.py: windows come from branches rolled out while the target verifies

Every proposer has the same four methods, so that the decode loop is written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.verify import Verdict, greedy_tokens, top_k_logprobs


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [g] draft tokens following the last committed token
    reused: bool  # taken from a branch rolled out before the verdict (Mirror-SD)
    draft_forwards: int  # draft graph calls spent on this window after the previous verdict


@dataclass(frozen=True)
class Rollout:
    tokens: np.ndarray  # [g]
    top_ids: np.ndarray  # [g, k] the draft's best tokens at each window position (k may be 0)
    top_logprobs: np.ndarray  # [g, k]
    forwards: int


class Proposer(Protocol):
    mode: str

    def reset(self, prompt: list[int]) -> None: ...

    def propose(self, committed: list[int], gamma: int) -> Proposal: ...

    def exit_callback(self):  # the early-exit hand-off, or None when the proposer does not use it
        ...

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None: ...

    def finish(self, timeout: float | None = None) -> None: ...


def greedy_rollout(draft: DraftModel, committed: list[int], gamma: int, top_k: int = 0) -> Rollout:
    """Roll the draft's main cache back to ``committed``, then draft ``gamma`` tokens greedily (gamma forwards)."""
    pending = draft.sync_to(committed)
    tokens, top_ids, top_lps = [], [], []
    feed = pending
    for _ in range(gamma):
        logits = draft.extend(feed)[-1:]  # [1, vocab]
        token = int(greedy_tokens(logits)[0])
        if top_k:
            ids, lps = top_k_logprobs(logits, top_k)
            top_ids.append(ids[0])
            top_lps.append(lps[0])
        tokens.append(token)
        feed = [token]
    shape = (gamma, top_k)
    return Rollout(np.asarray(tokens, np.int64),
                   np.asarray(top_ids, np.int64).reshape(shape), np.asarray(top_lps, np.float32).reshape(shape),
                   gamma)


class TargetOnly:
    """No draft: the decode loop runs one target token per step (autoregressive decoding)."""

    mode = "ar"

    def reset(self, prompt: list[int]) -> None:
        pass

    def propose(self, committed: list[int], gamma: int) -> Proposal:
        return Proposal(np.zeros(0, np.int64), False, 0)

    def exit_callback(self):
        return None

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        pass

    def finish(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class SerialDraft(TargetOnly):
    """Vanilla speculative decoding: after each verdict the draft rolls out the next window, then the target."""

    mode = "sd"

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft
        self.committed: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        self.draft.reset(capacity=len(prompt) + 64)
        self.committed = list(prompt)

    def propose(self, committed: list[int], gamma: int) -> Proposal:
        rollout = greedy_rollout(self.draft, committed, gamma)
        return Proposal(rollout.tokens, False, rollout.forwards)
