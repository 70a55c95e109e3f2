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

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import Verdict, top_k_logprobs


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [g] draft tokens following the last committed token
    reused: bool  # taken from a branch rolled out before the verdict (Mirror-SD)
    draft_forwards: int  # draft graph calls spent on this window after the previous verdict
    probs: np.ndarray | None = None  # [g, vocab] float32 q: what each token was drawn from (residual rule only)


@dataclass(frozen=True)
class Rollout:
    tokens: np.ndarray  # [g]
    top_ids: np.ndarray  # [g, k] the draft's best tokens at each window position (k may be 0)
    top_logprobs: np.ndarray  # [g, k]
    forwards: int
    probs: np.ndarray | None = None  # [g, vocab] q per token (when the sampler's drafts sample)


class Proposer(Protocol):
    mode: str

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None: ...

    def propose(self, committed: list[int], gamma: int) -> Proposal: ...

    def exit_callback(self):  # the early-exit hand-off, or None when the proposer does not use it
        ...

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None: ...

    def finish(self, timeout: float | None = None) -> None: ...


def draft_rollout(draft: DraftModel, committed: list[int], gamma: int, top_k: int = 0,
                  sampler: Sampler = GREEDY) -> Rollout:
    """Roll the draft's main cache back to ``committed``, then draft ``gamma`` tokens (gamma forwards), each picked
    by ``sampler`` (greedy: the argmax) at its absolute position."""
    pending = draft.sync_to(committed)
    tokens, top_ids, top_lps, probs = [], [], [], []
    feed = pending
    for i in range(gamma):
        logits = draft.extend(feed)[-1:]  # [1, vocab]
        context = [committed + tokens] if sampler.needs_context else None  # penalty context of this token
        picked, q = sampler.draft(logits, [len(committed) + i], context)
        token = int(picked[0])
        if q is not None:
            probs.append(q[0])
        if top_k:
            ids, lps = top_k_logprobs(logits, top_k)
            top_ids.append(ids[0])
            top_lps.append(lps[0])
        tokens.append(token)
        feed = [token]
    shape = (gamma, top_k)
    return Rollout(np.asarray(tokens, np.int64),
                   np.asarray(top_ids, np.int64).reshape(shape), np.asarray(top_lps, np.float32).reshape(shape),
                   gamma, np.stack(probs) if probs else None)


class TargetOnly:
    """No draft: the decode loop runs one target token per step (autoregressive decoding)."""

    mode = "ar"

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
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

    def __init__(self, draft: DraftModel, rollout=draft_rollout) -> None:
        self.draft, self.rollout = draft, rollout  # rollout: draft_rollout, or streaming_rollout (streaming.py)
        self.committed: list[int] = []
        self.sampler = GREEDY

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        self.draft.reset(capacity=len(prompt) + 64)
        self.committed = list(prompt)
        self.sampler = sampler

    def propose(self, committed: list[int], gamma: int) -> Proposal:
        try:
            rollout = self.rollout(self.draft, committed, gamma, sampler=self.sampler)
        except Exception as exc:  # as in mirror: a draft failure is a DraftWorkerError, which on_draft_failure handles
            raise DraftWorkerError("The draft model failed", f"{type(exc).__name__}: {exc}",
                                   "see the chained exception; the target itself is unaffected") from exc
        return Proposal(rollout.tokens, False, rollout.forwards, rollout.probs)
