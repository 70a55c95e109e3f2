"""The target's one-row step and a 5-row window at a few depths, for two or more builds of mirrorsd's kernels library:
one process per (build, round), the builds' order alternated each round, medians over the rounds. A whole step sees
what a one-node A/B does not (the weights streaming between layers, the pool spinning within a run).

    python scripts/lab/kernel_step_ab.py EXPORT LIB1.so,LIB2.so[,...] [DEPTHS (300,4096)] [ROUNDS (6)]

Each process prefills random token ids to each depth, then times 24 greedy one-row steps (median) and 8 five-row
windows (median), the cache truncated back after each window. Build a variant with `python -m mirrorsd.devices.kernels`
(it prints the library's path; copy the file before building the next one). A 4096-token prefill takes about a minute.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

CHILD = r'''
import dataclasses, json, statistics, sys, time
from pathlib import Path
import mirrorsd.devices.kernels as kernels
default = kernels.library
kernels.library = lambda: dataclasses.replace(default(), path=Path(sys.argv[2]))  # every session registers this build
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.verify import greedy_tokens
out = {}
with Pipeline.load(sys.argv[1], DeviceRequest(spin_in_run=True)) as pipe:
    for depth in [int(d) for d in sys.argv[3].split(",")]:
        text = [1000 + (i * 7919) % 50000 for i in range(depth + 64)]
        pipe.target.reset(1, depth + 64)
        pipe.target.prefill(text[:depth])
        steps, token = [], text[depth]
        for _ in range(24):
            start = time.perf_counter()
            token = int(greedy_tokens(pipe.target.extend([token]))[-1])
            steps.append(time.perf_counter() - start)
        pipe.target.truncate(depth)
        windows = []
        for _ in range(8):
            start = time.perf_counter()
            pipe.target.extend(text[depth:depth + 5])
            windows.append(time.perf_counter() - start)
            pipe.target.truncate(depth)
        out[depth] = (statistics.median(steps) * 1e3, statistics.median(windows) * 1e3)
print(json.dumps(out))
'''


def main() -> None:
    export, libraries = sys.argv[1], sys.argv[2].split(",")
    depths = sys.argv[3] if len(sys.argv) > 3 else "300,4096"
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    runs: dict[str, list[dict]] = {library: [] for library in libraries}
    for r in range(rounds):
        for library in libraries if r % 2 == 0 else libraries[::-1]:
            done = subprocess.run([sys.executable, "-c", CHILD, export, library, depths], capture_output=True, text=True)
            if done.returncode:
                sys.exit(done.stderr[-2000:])
            runs[library].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {library}: {runs[library][-1]}", flush=True)
    for depth in depths.split(","):
        cells = []
        for library in libraries:
            one = statistics.median(run[depth][0] for run in runs[library])
            five = statistics.median(run[depth][1] for run in runs[library])
            cells.append(f"{library}: 1 row {one:.2f} ms, 5 rows {five:.2f} ms ({five / one:.2f} steps)")
        print(f"depth {depth}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
