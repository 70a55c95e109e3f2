"""The decode skeleton shared by every strategy: propose -> verify -> commit -> roll back.

    prefill:  target(prompt) -> first token c0           (cache: prompt; c0 pending; PREFILL_CHUNK tokens a forward)
    step:     window = proposer.propose(committed, g)    (g = 0 for ar)
              logits = target([last] + window)           (exit head hands top-k to the proposer on the way)
              verdict = verify(window, logits)           (A accepted, correction c: greedy argmax, or a sampling
                                                          rule at T > 0, see sampling.py)
              commit window[:A] + [c]; target cache keeps committed[:-1]; proposer.observe(verdict)
Invariant: the target cache holds KV for every committed token but the last one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime.models import TargetModel
from mirrorsd.runtime.proposers import Proposer, TargetOnly
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.stats import StepCounters
from mirrorsd.runtime.verify import top2_margin


FINISH_REASONS = ("eos", "length", "context")  # an EOS token; max_new_tokens reached; the context limit reached


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    context_limit: int
    gamma: int = 0
    record_margins: bool = False  # top-1 minus top-2 logit of every emitted token (tie-aware oracle)
    on_draft_failure: str = "raise"  # "raise" or "fallback" (continue target-only; counted in statistics)
    sampler: Sampler = GREEDY  # how tokens are picked: greedy (plain argmax) or sampled with a verification rule


@dataclass
class DecodeOutcome:
    tokens: list[int]
    counters: StepCounters
    seconds: float
    time_to_first_token_s: float
    margins: list[float] = field(default_factory=list)
    finish_reason: str = ""  # why generation stopped: one of FINISH_REASONS (set when it does)


def decode(target: TargetModel, proposer: Proposer, prompt: list[int], settings: DecodeSettings,
           emit: Callable[[list[int]], None] = lambda tokens: None) -> DecodeOutcome:
    started = time.perf_counter()
    counters = StepCounters()
    # the budget may exceed the context (max_new_tokens=10**9): the cache never holds more than the context
    target.reset(1, min(len(prompt) + settings.max_new_tokens, settings.context_limit) + settings.gamma + 2)
    sampler = settings.sampler
    proposer.reset(prompt, sampler)
    try:  # from here on the proposer may run a worker thread: stop it however this ends (emit may raise too)
        logits = target.prefill(prompt)  # [1, vocab]
        first = sampler.first_token(logits, prompt)
        outcome = DecodeOutcome([], counters, 0.0, time.perf_counter() - started)
        committed = list(prompt)
        done = _commit([first], committed, outcome, settings, emit, logits if settings.record_margins else None)
        gamma = _room(settings, committed, outcome)
        while not done:
            proposal, proposer = _propose(proposer, committed, gamma, settings, counters)
            window = proposal.tokens[:gamma]
            logits = target.extend([committed[-1], *window.tolist()], proposer.exit_callback() if gamma else None)
            probs = None if proposal.probs is None else proposal.probs[:gamma]
            verdict = sampler.verify(window, probs, logits, committed)
            # mode auto running ar drafts no window although gamma > 0: a target-only step, not a fallback
            counters.record(len(window), verdict.accepted,
                            None if not gamma or proposal.target_only else proposal.reused, proposal.forwards)
            new = [*window[: verdict.accepted].tolist(), verdict.correction]
            done = _commit(new, committed, outcome, settings, emit,
                           logits[: verdict.accepted + 1] if settings.record_margins else None)
            target.truncate(len(committed) - 1)
            gamma = 0 if done else _room(settings, committed, outcome)
            if gamma > 0:
                proposer.observe(verdict, new, gamma)
            else:
                proposer.finish()
    finally:
        proposer.finish()
    outcome.seconds = time.perf_counter() - started
    return outcome


def _propose(proposer: Proposer, committed, gamma, settings: DecodeSettings, counters: StepCounters):
    if gamma == 0:
        return TargetOnly().propose(committed, 0), proposer
    try:
        return proposer.propose(committed, gamma), proposer
    except DraftWorkerError:
        if settings.on_draft_failure != "fallback":
            raise
        counters.draft_failures += 1
        try:
            proposer.finish(timeout=1.0)
        except DraftWorkerError:
            pass  # a hung draft call: its thread exits when the call returns (it finds Stop); we go on without it
        fallback = TargetOnly()
        return fallback.propose(committed, gamma), fallback


def _commit(new: list[int], committed: list[int], outcome: DecodeOutcome, settings: DecodeSettings, emit,
            logits: np.ndarray | None) -> bool:
    """Append accepted tokens, stopping at EOS or the token budget; True when generation is over."""
    room = settings.max_new_tokens - len(outcome.tokens)
    take = new[:room]
    for i, token in enumerate(take):
        if token in settings.eos_token_ids:
            take = take[: i + 1]
            outcome.finish_reason = "eos"
            break
    if logits is not None:
        outcome.margins.extend(top2_margin(logits[: len(take)]).tolist())
    committed.extend(take)
    outcome.tokens.extend(take)
    emit(take)
    if not outcome.finish_reason:  # the budget the caller chose first, then the one the graphs impose
        if len(outcome.tokens) >= settings.max_new_tokens:
            outcome.finish_reason = "length"
        elif len(committed) >= settings.context_limit:
            outcome.finish_reason = "context"
    return bool(outcome.finish_reason)


def _room(settings: DecodeSettings, committed: list[int], outcome: DecodeOutcome) -> int:
    """Window size for the next step: gamma, fewer near the token budget or the context limit."""
    budget = settings.max_new_tokens - len(outcome.tokens) - 1
    context = settings.context_limit - len(committed)
    return max(0, min(settings.gamma, budget, context))
