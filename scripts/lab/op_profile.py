"""Where a forward's time goes, by operator type, for windows of W rows: ONNX Runtime's own profiler on one graph.

    python scripts/lab/op_profile.py GRAPH.onnx [--past 300] [--widths 1,5] [--runs 20] [--threads 2]

Feeds batch 1, W new tokens (or hidden rows) and PAST cached slots (random KV, all slots visible), with mirrorsd's
MatMulNBits kernel and 2 threads spinning within a run, as graph_ab.py opens sessions. Runs each width --runs times
with the profiler on (after 3 unprofiled warm-up runs) and prints one table: per operator type, the mean ms per
forward at each width and the ratio to the first width, then the sum over nodes and the wall time per forward. The
profiler adds a little per node; compare widths with each other, not with timings taken without it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_ab import _feeds, _session  # noqa: E402  (the same sessions and feeds as graph_ab.py)


def profile(path: str, past: int, width: int, runs: int, threads: int) -> tuple[dict[str, float], float]:
    """(mean ms per forward by operator type, mean wall ms per forward) for windows of ``width`` rows."""
    with tempfile.TemporaryDirectory() as folder:
        session = _session(path, threads, os.path.join(folder, "profile"))
        feeds = _feeds(session, past, width)
        for _ in range(3):
            session.run(None, feeds)
        start = time.perf_counter()
        for _ in range(runs):
            session.run(None, feeds)
        wall = (time.perf_counter() - start) / runs * 1e3
        with open(session.end_profiling()) as f:
            events = json.load(f)
    by_type: dict[str, float] = defaultdict(float)
    node_events = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    for event in node_events[-runs * (len(node_events) // (runs + 3)):]:  # the timed runs, not the warm-up
        by_type[event["args"]["op_name"]] += event["dur"] / 1e3 / runs
    return dict(by_type), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("graph")
    parser.add_argument("--past", type=int, default=300)
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    results = [profile(args.graph, args.past, w, args.runs, args.threads) for w in widths]
    types = sorted({t for by_type, _ in results for t in by_type}, key=lambda t: -results[-1][0].get(t, 0.0))
    print(f"{args.graph}, {args.past} cached slots, {args.threads} threads, {args.runs} profiled runs per width")
    print("| operator | " + " | ".join(f"W={w} ms" for w in widths) + f" | W={widths[-1]} / W={widths[0]} |")
    print("|---|" + "---|" * (len(widths) + 1))
    for name in types:
        cells = [r[0].get(name, 0.0) for r in results]
        ratio = cells[-1] / cells[0] if cells[0] else float("inf")
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {ratio:.2f} |")
    sums = [sum(r[0].values()) for r in results]
    print("| sum over nodes | " + " | ".join(f"{s:.2f}" for s in sums) + f" | {sums[-1] / sums[0]:.2f} |")
    walls = [r[1] for r in results]
    print("| wall per forward | " + " | ".join(f"{w:.2f}" for w in walls) + f" | {walls[-1] / walls[0]:.2f} |")


if __name__ == "__main__":
    main()
