"""Old vs new per mode: tok/s of each run, mean per side, new/old ratio, old-vs-old spread."""
import json
import sys
from pathlib import Path
from statistics import mean

root = Path(sys.argv[1])
tags = [t for t in sys.argv[2:] if (root / t / "runs.json").exists()]
data = {t: json.loads((root / t / "runs.json").read_text()) for t in tags}
def tps(t, m, key="tokens_per_second"):
    return mean(r["stats"][key] for r in data[t] if r["mode"] == m)
def parity(t, m):
    rs = [r for r in data[t] if r["mode"] == m]
    return f"{sum(r['parity'] == 'identical' for r in rs)}/{len(rs)}" if m != "ar" else "reference"
old = [t for t in tags if t.startswith("old")]
new = [t for t in tags if t.startswith("new")]
print("| mode | " + " | ".join(f"{t} tok/s" for t in tags) + " | old mean | new mean | new/old | old-vs-old spread | parity vs ar (every run) | tokens/window |")
print("|---|" + "---|" * len(tags) + "---|---|---|---|---|---|")
for m in ("ar", "sd", "mirror"):
    vals = [tps(t, m) for t in tags]
    o, n = mean(tps(t, m) for t in old), mean(tps(t, m) for t in new)
    oo = [tps(t, m) for t in old]
    spread = f"{100 * (max(oo) - min(oo)) / min(oo):.1f} %" if len(oo) > 1 else "-"
    par = ", ".join(sorted({parity(t, m) for t in tags}))
    acc = sorted({round(mean(r['stats']['mean_accepted_tokens'] for r in data[t] if r['mode'] == m), 2) for t in tags})
    print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {o:.2f} | {n:.2f} | {n / o:.3f} | {spread} | {par} | {', '.join(map(str, acc))} |")
