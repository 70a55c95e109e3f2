"""Reading a prompt with every row of each chunk scored against the last row only (DeviceRequest.
prompt_last_row_only, devices/kernels/logits_rows.py): the target's prefill and the draft's, two pipelines in one
process, alternated round by round.

    python scripts/lab/prompt_rows_ab.py EXPORT [TOKENS (1024)] [ROUNDS (4)]

The prompt is TOKENS synthetic ids, read from an empty cache in chunks of PREFILL_CHUNK. Prints each model's median
seconds and tokens/s both ways, their ratio, and whether the target's first-token logits are the same bits.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline


def main() -> None:
    folder = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    pipes = {flag: Pipeline.load(folder, DeviceRequest(spin_in_run=True, prompt_last_row_only=flag))
             for flag in (False, True)}
    tokens = [1000 + (i * 7919) % 50000 for i in range(count)]
    seconds = {(flag, model): [] for flag in pipes for model in ("target", "draft")}
    first = {}
    for r in range(rounds):
        for flag in (False, True) if r % 2 == 0 else (True, False):
            pipe = pipes[flag]
            pipe.target.reset(1, count + 8)
            start = time.perf_counter()
            first[flag] = pipe.target.prefill(tokens)
            seconds[flag, "target"].append(time.perf_counter() - start)
            pipe.draft.reset(count + 8)
            start = time.perf_counter()
            pipe.draft.prefill(tokens)
            seconds[flag, "draft"].append(time.perf_counter() - start)
    for model in ("target", "draft"):
        every, last = (statistics.median(seconds[flag, model]) for flag in (False, True))
        print(f"{model} prefill of {count} tokens: every row {every:.2f} s ({count / every:.1f} tok/s), last row only "
              f"{last:.2f} s ({count / last:.1f} tok/s), ratio {last / every:.3f}")
    print("the target's first-token logits the same bits:", np.array_equal(first[False], first[True]))
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main()
