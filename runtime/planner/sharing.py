"""One Mirror-SD step on a machine the target and the draft share: when the exit's message leaves, when the
verdict is ready and when the draft's first branch batch is finished.

Processor sharing: while both models compute, the target advances at 1 / c_target of its speed alone and the draft at
1 / c_draft of its own (the profile's contention, measured with both busy); while only one computes, it runs at
full speed. A model's cost is its work, in seconds alone.

    target   [prefix + exit head] -> the exit's message leaves -> [the rest of the verification] -> verdict
    draft    [one forward on the window's last token] -> (exit head on: idle until the exit's message)
             -> [first batch: gamma branch forwards] -> further batches, busy until the verdict

The idle stretch is why this is not one factor on the whole step: with the exit head the draft finishes its first
forward early and waits for the message, and the target computes alone meanwhile. A model that slowed the target by
c_target over the whole verification predicted Mirror-SD 30 % slower than it ran on a 2-core Intel Xeon
(docs/lab-notes/performance-log.md, "The latency model of Mirror-SD on a shared CPU").

Pure function of numbers (no sessions, no threads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_DONE = 1e-12  # seconds of work below which a segment counts as finished (float residue of the subtractions)
_MAX_EVENTS = 1000  # passes of the loop before it gives up (a step takes about 10)


@dataclass(frozen=True)
class MirrorTimeline:
    exit_s: float  # the exit's message reaches the draft (0 without the exit head)
    verdict_s: float  # the target's verdict is ready
    batch_s: float  # the draft's first branch batch is finished


def mirror_timeline(target_s: float, gate_s: float, draft_one_s: float, batch_s: float, c_target: float = 1.0,
                    c_draft: float = 1.0) -> MirrorTimeline:
    """The step's events in seconds from its start. ``target_s``: the verification's work (exit head included when
    it runs); ``gate_s``: the part of it before the exit's message leaves (0: the draft waits for nothing);
    ``draft_one_s``: the forward on the window's last token; ``batch_s``: the first batch of branch forwards."""
    if not all(math.isfinite(x) for x in (target_s, gate_s, draft_one_s, batch_s, c_target, c_draft)):
        return MirrorTimeline(math.inf, math.inf, math.inf)  # (a profile refuses such costs; never loop on them)
    gate_s = min(max(gate_s, 0.0), target_s)
    target_left = [gate_s, target_s - gate_s]  # work before / after the exit's message
    draft_left = [draft_one_s, batch_s]  # work of the first forward / the first batch
    t, exit_at, verdict, batch_done = 0.0, None, None, None
    ti = di = 0  # the segment each model is in (ti 2: done; di 2: further batches until the verdict)
    for _ in range(_MAX_EVENTS):  # each pass handles an event or runs to the next one
        if verdict is not None and batch_done is not None:
            return MirrorTimeline(exit_at, verdict, batch_done)
        if ti == 0 and target_left[0] <= _DONE:  # the exit's message leaves
            ti, exit_at = 1, t
            continue
        if ti == 1 and target_left[1] <= _DONE:
            ti, verdict = 2, t
            continue
        if di == 0 and draft_left[0] <= _DONE and exit_at is not None:  # (exit head on: waits until it leaves)
            di = 1
            continue
        if di == 1 and draft_left[1] <= _DONE:
            di, batch_done = 2, t
            continue
        target_on = ti < 2
        draft_on = (di == 0 and draft_left[0] > _DONE) or di == 1 or (di == 2 and target_on)
        both = target_on and draft_on
        rate_target = 1.0 / c_target if both else 1.0
        rate_draft = 1.0 / c_draft if both else 1.0
        until_target = target_left[ti] / rate_target if target_on else math.inf
        until_draft = draft_left[di] / rate_draft if di < 2 and draft_on else math.inf
        dt = min(until_target, until_draft)
        t += dt
        if target_on:
            target_left[ti] -= dt * rate_target
        if di < 2 and draft_on:
            draft_left[di] -= dt * rate_draft
    return MirrorTimeline(math.inf, math.inf, math.inf)  # float residue that never settles: rank it last
