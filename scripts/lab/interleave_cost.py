"""Is a target pass slower right after a draft forward than back to back (caches, pools, page walks)? Times verify(w)
(extend w tokens + argmax + truncate) on a 112-token cache alone, after one and after two draft forwards (as sd
interleaves them), and a draft forward alone and after a target pass; all variants in every round, medians.

    python scripts/lab/interleave_cost.py EXPORT [ROUNDS (15)]
"""
import statistics, sys, time
import numpy as np
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.verify import greedy_tokens

folder = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
with Pipeline.load(folder, DeviceRequest(spin_in_run=True)) as pipe:
    prompt = pipe.encode("Write a Python function that returns the n-th Fibonacci number, then explain how it works.",
                         GenerationConfig(chat=True))
    ctx = (prompt * 4)[:112]
    pipe.target.reset(1, 200); pipe.target.extend(ctx); base = pipe.target.length
    pipe.draft.reset(capacity=200); pipe.draft.extend(ctx); dbase = pipe.draft.cache.length
    window = ctx[:7]
    res = {}
    def target(w):
        s = time.perf_counter(); greedy_tokens(pipe.target.extend(window[:w])); e = time.perf_counter()
        pipe.target.truncate(base); return e - s
    def draft():
        s = time.perf_counter(); pipe.draft.extend(window[:1]); e = time.perf_counter()
        pipe.draft.truncate(dbase); return e - s
    for r in range(rounds + 1):
        for w in (1, 2, 3, 5):
            for kind in ("alone", "after draft", "after 2 drafts"):
                ts = []
                for _ in range(3):
                    if kind != "alone":
                        d = draft()
                        if kind == "after 2 drafts":
                            draft()
                    ts.append(target(w))
                if r:
                    res.setdefault((w, kind), []).extend(ts)
        # the draft alone vs after a target pass
        for kind in ("draft alone", "draft after target"):
            ts = []
            for _ in range(3):
                if kind != "draft alone":
                    target(3)
                ts.append(draft())
            if r:
                res.setdefault((0, kind), []).extend(ts)
    for key in sorted(res):
        print(key, f"{statistics.median(res[key]) * 1e3:7.2f} ms (n={len(res[key])})")
