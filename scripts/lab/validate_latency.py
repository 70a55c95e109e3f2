"""Predicted against measured: the latency model (runtime/planner/latency.py) on a measured profile, against bench runs.

    python scripts/lab/validate_latency.py --profile ~/.cache/mirrorsd/profiles/qwen-t4d4-XXXX.json \
        --runs bench_a/runs.json:2+2 --runs bench_b/runs.json:1+1 [--gamma 4]

Each --runs is a `mirrorsd bench` runs.json and the thread split its own modes ran with (ar-Nt / sd-Nt rows run
with N+N whatever the file's split). Per mode it prints the measured decode speed (tokens after the first / time
after the first token, summed over prompts), the prediction from the run's own acceptance (alpha from its mean
accepted tokens, its reuse rate: this checks the step-time model), the prediction from the profile's calibration
(what auto sees before generating), and the error of the first. Predictions are for the runs' own shape (mean
prompt tokens, tokens after the first), so sd's draft prefill is spread over its steps as in the runs.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from mirrorsd.runtime.planner import profile as profiles
from mirrorsd.runtime.planner.latency import Acceptance, Strategy, alpha_from_mean_accepted, predict


def strategy_of(mode: str, gamma: int, split: str) -> tuple[Strategy, str] | None:
    threads = re.fullmatch(r"(ar|sd)-(\d+)t", mode)
    if threads:
        n = threads.group(2)
        return Strategy(threads.group(1), 0 if threads.group(1) == "ar" else gamma), f"{n}+{n}"
    base = {"ar": Strategy("ar"), "sd": Strategy("sd", gamma), "mirror": Strategy("mirror", gamma),
            "mirror-noexit": Strategy("mirror", gamma, exit_head=False)}
    return (base[mode], split) if mode in base else None


def auto_strategy(name: str) -> tuple[Strategy, str]:
    """'sd g1 2+2' / 'mirror-noexit g4 2+2' / 'ar 2+2' -> (Strategy, split)."""
    parts = name.split()
    mode, split = parts[0], parts[-1]
    gamma = int(parts[1][1:]) if len(parts) == 3 else 0
    return Strategy(mode.split("-")[0], gamma, exit_head="noexit" not in mode), split


def measured(runs: list[dict]) -> dict:
    tokens = sum(max(r["stats"]["new_tokens"] - 1, 0) for r in runs)
    seconds = sum(r["stats"]["seconds"] - r["stats"]["time_to_first_token_s"] for r in runs)
    steps = sum(r["stats"]["steps"] for r in runs)
    accepted = sum(r["stats"]["accepted"] for r in runs)
    windows = sum(r["stats"]["windows"] for r in runs)
    return {"tps": tokens / seconds, "mean_accepted": (accepted + steps) / steps if steps else 1.0,
            "reuse": sum(r["stats"]["reused"] for r in runs) / windows if windows else 0.0,
            "bench_tps": sum(r["stats"]["tokens_per_second"] for r in runs) / len(runs), "prompts": len(runs),
            "context": sum(r["stats"]["prompt_tokens"] for r in runs) / len(runs),
            "new_tokens": tokens / len(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--runs", action="append", required=True, help="runs.json:T+D")
    parser.add_argument("--gamma", type=int, default=4, help="the bench's --gamma")
    args = parser.parse_args()
    profile = profiles.load(args.profile)
    splits = {s.split: s for s in profile.splits}
    print("| mode | threads | prompts | measured decode tok/s | mean accepted | reuse | predicted (run's acceptance) "
          "| error | predicted (calibration) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for item in args.runs:
        path, split = item.rsplit(":", 1)
        by_mode: dict[str, list] = {}
        for run in json.loads(Path(path).read_text()):
            by_mode.setdefault(run["mode"], []).append(run)
        for mode, runs in by_mode.items():
            m = measured(runs)
            if mode == "auto":
                chosen = {r["stats"]["auto"]["final"] for r in runs}
                if len(chosen) != 1:
                    print(f"| auto | {split} | {m['prompts']} | {m['tps']:.1f} | {m['mean_accepted']:.2f} | "
                          f"{m['reuse']:.2f} | mixed: {', '.join(sorted(chosen))} | - | - |")
                    continue
                strategy, where = auto_strategy(chosen.pop())
                label = f"auto ({strategy.mode}{'' if strategy.exit_head or strategy.mode != 'mirror' else '-noexit'}"\
                        f" g{strategy.gamma})"
            else:
                found = strategy_of(mode, args.gamma, split)
                if found is None:
                    continue
                (strategy, where), label = found, mode
            costs = splits[where]
            gamma = max(strategy.gamma, 1)
            own = Acceptance(alpha_from_mean_accepted(m["mean_accepted"], gamma), m["reuse"], m["reuse"], "run")
            shape = dict(context=round(m["context"]), new_tokens=round(m["new_tokens"]))  # start-up spread over it
            p_own = predict(costs, strategy, own, **shape).tokens_per_second
            p_cal = predict(costs, strategy, profile.acceptance, **shape).tokens_per_second
            error = (p_own - m["tps"]) / m["tps"]
            print(f"| {label} | {where} | {m['prompts']} | {m['tps']:.1f} | {m['mean_accepted']:.2f} | "
                  f"{m['reuse']:.2f} | {p_own:.1f} | {error:+.0%} | {p_cal:.1f} |")


if __name__ == "__main__":
    main()
