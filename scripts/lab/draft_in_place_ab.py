"""The draft's one-row forward with its KV cache written in place (InPlaceAttention, runtime/view_cache.py) against
the fused draft (GroupedAttention, its past fed from KVCache and its presents copied back), at given depths.

    python scripts/lab/draft_in_place_ab.py EXPORT [DEPTHS (300,1000,2000)] [ROUNDS (30)]

Two pipelines in one process (DeviceRequest.draft_kv_in_place on and off, sessions spinning within a run only);
each depth's prompt (random ids) is read by both drafts, then one-row forwards alternate between them, the cache
truncated back after each, so every forward sees the same depth. Prints the median ms of each, their ratio, and
whether the two drafts' logits are the same (max |difference|).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.models import single_row_inputs


def main() -> None:
    folder = sys.argv[1]
    depths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "300,1000,2000").split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    pipes = {flag: Pipeline.load(folder, DeviceRequest(spin_in_run=True, draft_kv_in_place=flag))
             for flag in (False, True)}
    for flag, pipe in pipes.items():
        print(f"draft_kv_in_place={flag}: {pipe.placements['draft'].describe()}, "
              f"cache {type(pipe.draft.cache).__name__}")
    rng = np.random.default_rng(0)
    for depth in depths:
        tokens = rng.integers(1000, 20000, depth + 1).tolist()
        for pipe in pipes.values():
            pipe.draft.reset(depth + 64)
            pipe.draft.prefill(tokens[:depth])
        times: dict[bool, list[float]] = {False: [], True: []}
        logits = {}
        for r in range(rounds):
            for flag in (False, True) if r % 2 == 0 else (True, False):
                draft = pipes[flag].draft
                ids, mask, positions = single_row_inputs(tokens[depth:], depth)
                start = time.perf_counter()
                logits[flag] = draft.forward(draft.cache, ids, mask, positions)
                times[flag].append(time.perf_counter() - start)
                draft.cache.truncate(depth)
        before, after = (statistics.median(times[f]) * 1e3 for f in (False, True))
        diff = float(np.abs(logits[True] - logits[False]).max())
        print(f"{depth} cached tokens: fused {before:.2f} ms, in place {after:.2f} ms, ratio {after / before:.3f}; "
              f"logits max |diff| {diff:.2e}")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main()
