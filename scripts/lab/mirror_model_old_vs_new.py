"""Mirror-SD's predicted decode speed on a bench run, by the latency model before 2026-12-06 (c_target on the whole
verification, c_draft on the whole first batch) and by the processor-sharing timeline (runtime/planner/sharing.py),
beside what the run measured; each prompt priced from its own acceptance, as the bench's latency check does.

    python scripts/lab/mirror_model_old_vs_new.py RUNS_JSON PROFILE_JSON SPLIT (e.g. 2+2) [GAMMA (4)]
"""
from __future__ import annotations

import json
import statistics
import sys

from mirrorsd.apps.latency_check import predicted_tps
from mirrorsd.runtime.planner import latency
from mirrorsd.runtime.planner import profile as profiles


def one_factor_step(costs, gamma, exit_head, reuse, window_s):
    """The step as the model computed it before the timeline (kept here for the comparison only)."""
    verify = costs.c_target * (costs.verify_s[gamma] + (costs.exit_s[gamma] if exit_head else 0.0))
    start = costs.c_target * (costs.prefix_s[gamma] + costs.exit_s[gamma]) \
        if exit_head and len(costs.prefix_s) > gamma else 0.0
    first = max(costs.c_draft * costs.draft1_s, start) + costs.c_draft * gamma * costs.branch_fwd_s
    hit = (first - verify) / costs.c_draft if first > verify else 0.5 * costs.branch_fwd_s
    return verify + reuse * hit + (1 - reuse) * (0.5 * costs.branch_fwd_s + window_s)


def main(runs_path: str, profile_path: str, split: str, gamma: int) -> None:
    runs = json.loads(open(runs_path).read())
    costs = next(c for c in profiles.from_json(json.loads(open(profile_path).read())).splits if c.split == split)
    print("| mode | measured decode tok/s | one factor (error) | timeline (error) |\n|---|---:|---:|---:|")
    for mode in ("mirror", "mirror-noexit"):
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        timeline = statistics.mean(predicted_tps(costs, mode, r["stats"], gamma) for r in rows)
        kept, latency.mirror_step = latency.mirror_step, one_factor_step
        try:
            one = statistics.mean(predicted_tps(costs, mode, r["stats"], gamma) for r in rows)
        finally:
            latency.mirror_step = kept
        measured = statistics.mean(r["stats"]["decode_tokens_per_second"] for r in rows)
        print(f"| {mode} ({split}) | {measured:.2f} | {one:.2f} ({measured / one - 1:+.0%}) | "
              f"{timeline:.2f} ({measured / timeline - 1:+.0%}) |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 4)
