"""Summarize bench runs (runs.json) of several tags: per mode tok/s (mean over prompts, SpecBench style), decode
tok/s, mean accepted tokens per window, reuse, parity vs ar, and token equality of every run with the first tag."""
import json
import sys
from pathlib import Path
from statistics import mean

root = Path(sys.argv[1])
tags = sys.argv[2:]
runs = {t: json.loads((root / t / "runs.json").read_text()) for t in tags}
modes = []
for r in runs[tags[0]]:
    if r["mode"] not in modes:
        modes.append(r["mode"])
ref = {(r["question_id"], r["mode"]): r["tokens"] for r in runs[tags[0]]}
print("| run | mode | tok/s | decode tok/s | ms/step | steps | tokens/window | reuse | parity vs ar | tokens = " + tags[0] + " |")
print("|---|---|---|---|---|---|---|---|---|---|")
for t in tags:
    for m in modes:
        rs = [r for r in runs[t] if r["mode"] == m]
        s = [r["stats"] for r in rs]
        tps = mean(x["tokens_per_second"] for x in s)
        dtps = mean(x["decode_tokens_per_second"] for x in s)
        steps = sum(x["steps"] for x in s)
        dec_s = sum(x["seconds"] - x["time_to_first_token_s"] for x in s)
        acc = mean(x["mean_accepted_tokens"] for x in s)
        reuse = mean(x["reuse_rate"] for x in s) if m.startswith("mirror") else None
        par = {}
        for r in rs:
            par[r["parity"]] = par.get(r["parity"], 0) + 1
        same = sum(ref.get((r["question_id"], m)) == r["tokens"] for r in rs)
        print(f"| {t} | {m} | {tps:.2f} | {dtps:.2f} | {1000*dec_s/steps:.0f} | {steps} | {acc:.2f} | "
              f"{'-' if reuse is None else f'{reuse:.2f}'} | {', '.join(f'{k} {v}' for k, v in par.items())} | "
              f"{same}/{len(rs)} |")
