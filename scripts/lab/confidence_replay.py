"""Replay the draft-confidence stop on real windows: run sd at a long window with every pick's draft probability
recorded, then compute, for each threshold and window cap, what a confidence-stopped sd would have drafted,
verified and committed on the same steps (greedy: its tokens are the same, only the windows' lengths change),
and the bound of any stop rule on them (an oracle that drafts exactly what the target will accept, with this draft's
cost and with a free one).
Costs come from one-row draft forwards and w-row target passes timed here, interleaved, on the same pipeline.

    python scripts/lab/confidence_replay.py EXPORT [GAMMA (default 8)] [TOKENS (default 128)] [PER_CATEGORY (1)]
                                            [WINDOWS.json: the recorded windows and costs are written there]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from mirrorsd import specbench
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.proposers import SerialDraft

THRESHOLDS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
RECORD = 1e-9  # a threshold no pick falls below (p >= 1 / vocab): probabilities recorded, windows never cut


def record_windows(pipe, questions, gamma: int, tokens: int) -> dict:
    """category -> [(probabilities [gamma], accepted)] for every sd step."""
    steps: list = []
    propose, observe = SerialDraft.propose, SerialDraft.observe

    def propose_and_keep(self, committed, g):
        window = propose(self, committed, g)
        self._last = window
        return window

    def observe_and_keep(self, verdict, new_tokens, next_gamma):
        if len(self._last.tokens) == gamma:
            steps.append((self._last.confidence.tolist(), verdict.accepted))
        return observe(self, verdict, new_tokens, next_gamma)

    SerialDraft.propose, SerialDraft.observe = propose_and_keep, observe_and_keep
    out = {}
    try:
        for q in questions:
            steps.clear()
            pipe.generate(q.text, GenerationConfig(mode="sd", gamma=gamma, draft_confidence=RECORD,
                                                   max_new_tokens=tokens))
            out.setdefault(q.category, []).extend(steps)
    finally:
        SerialDraft.propose, SerialDraft.observe = propose, observe
    return out


def time_costs(pipe, gamma: int, context: int = 200, rounds: int = 12) -> tuple[float, list[float]]:
    """(one-row draft forward s, [verify(w) s for w = 1 .. gamma + 1]) at ``context`` cached tokens, interleaved."""
    ids = list(np.random.default_rng(0).integers(100, 20000, context))
    pipe.target.reset(1, context + gamma + 4)
    pipe.target.extend(ids)
    pipe.draft.reset(capacity=context + 8)
    pipe.draft.extend(ids)
    draft, verify = [], [[] for _ in range(gamma + 1)]
    for _ in range(rounds):
        t = time.perf_counter()
        pipe.draft.extend([ids[-1]])
        draft.append(time.perf_counter() - t)
        pipe.draft.truncate(context)
        for w in range(1, gamma + 2):
            t = time.perf_counter()
            pipe.target.extend(ids[:w])
            verify[w - 1].append(time.perf_counter() - t)
            pipe.target.truncate(context)
    return statistics.median(draft), [statistics.median(v) for v in verify]


def replay(steps, threshold: float, cap: int, draft_s: float, verify_s: list[float]) -> tuple[float, float, float]:
    """(tokens per step, seconds per step, drafted per step) of sd stopped at ``threshold`` with windows of at most
    ``cap`` tokens, on steps recorded at a longer window."""
    tokens = seconds = drafted = 0.0
    for probs, accepted in steps:
        length = cap
        for j, p in enumerate(probs[:cap]):
            if p < threshold:
                length = j + 1
                break
        tokens += min(accepted, length) + 1
        seconds += length * draft_s + verify_s[length]
        drafted += length
    n = len(steps)
    return tokens / n, seconds / n, drafted / n


def oracle(steps, cap: int, draft_s: float, verify_s: list[float]) -> tuple[float, float]:
    """(tokens per step, seconds per step) of a stop rule that knows the future: each window drafts exactly the
    tokens the target will accept (none: a plain target step), at most ``cap``; the bound of any stop rule with
    this draft and these costs."""
    tokens = seconds = 0.0
    for _, accepted in steps:
        length = min(accepted, cap)
        tokens += length + 1
        seconds += length * draft_s + verify_s[length]
    return tokens / len(steps), seconds / len(steps)


def main(folder: str, gamma: int, tokens: int, per_category: int, dump: str | None = None) -> None:
    questions = specbench.first_per_category(specbench.read(None), (), per_category)
    with Pipeline.load(folder, DeviceRequest(spin_in_run=True)) as pipe:
        pipe.generate("Say hello.", GenerationConfig(mode="sd", max_new_tokens=8))
        draft_s, verify_s = time_costs(pipe, gamma)
        windows = record_windows(pipe, questions, gamma, tokens)
    if dump:
        with open(dump, "w") as f:
            json.dump({"draft_s": draft_s, "verify_s": verify_s, "windows": windows}, f)
    step = verify_s[0]
    print(f"draft forward {draft_s * 1e3:.1f} ms = {draft_s / step:.2f} step; verify(w) / step: "
          + " ".join(f"{w + 1}:{v / step:.2f}" for w, v in enumerate(verify_s)))
    every = [s for steps in windows.values() for s in steps]
    groups = {"all": every, **windows}
    print("speed vs ar (tokens per step / step time in ar steps); rows: window cap, threshold")
    print(f"{'cap':>3} {'theta':>5} " + " ".join(f"{name[:10]:>10}" for name in groups))
    for cap in range(1, gamma + 1):
        for threshold in THRESHOLDS:
            cells = []
            for steps in groups.values():
                t, s, _ = replay(steps, threshold, cap, draft_s, verify_s)
                cells.append(f"{t / (s / step):10.3f}")
            print(f"{cap:>3} {threshold:5.2f} " + " ".join(cells))
    for label, title, cost in (("orcl", "oracle stop (drafts exactly what the target accepts), by window cap", draft_s),
                               ("free", "the same with a draft that costs nothing (what verification alone allows at "
                                        "this acceptance)", 0.0)):
        print(title)
        for cap in range(1, gamma + 1):
            cells = []
            for steps in groups.values():
                t, s = oracle(steps, cap, cost, verify_s)
                cells.append(f"{t / (s / step):10.3f}")
            print(f"{cap:>3} {label:>5} " + " ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8, int(sys.argv[3]) if len(sys.argv) > 3 else 128,
         int(sys.argv[4]) if len(sys.argv) > 4 else 1, sys.argv[5] if len(sys.argv) > 5 else None)
