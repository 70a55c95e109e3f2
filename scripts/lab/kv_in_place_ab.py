"""The target alone with its KV cache written in place (devices/kernels/kv_in_place.py) against the exported graphs'
Concat, in one process, alternated: tg (one-row greedy steps), pp (one chunk) and vf5 (5-row windows, what sd's
verification feeds, each rolled back) at each depth, ROUNDS rounds.

    python scripts/lab/kv_in_place_ab.py EXPORT DEPTHS [ROUNDS]        e.g. exports/qwen-int4 0,2048 3
"""
import sys, time
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.verify import greedy_tokens

depths = [int(d) for d in sys.argv[2].split(",")]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
pipes = {name: Pipeline.load(sys.argv[1], DeviceRequest(spin_in_run=True, target_kv_in_place=flag))
         for name, flag in (("in-place", True), ("concat", False))}
text = [1000 + (i * 7919) % 50000 for i in range(max(depths) + 300)]
for depth in depths:
    for pipe in pipes.values():
        pipe.target.reset(1, depth + 300)
        if depth:
            pipe.target.prefill(text[:depth])
    for r in range(rounds):
        for name, pipe in pipes.items():
            target = pipe.target
            s = time.perf_counter(); target.extend(text[depth:depth + 256]); pp = 256 / (time.perf_counter() - s)
            target.truncate(depth)
            tok, out = text[depth], []
            s = time.perf_counter()
            for _ in range(32):
                tok = int(greedy_tokens(target.extend([tok]))[-1])
                out.append(tok)
            tg = 32 / (time.perf_counter() - s)
            target.truncate(depth)
            s = time.perf_counter()
            for i in range(8):
                target.extend(text[depth + i:depth + i + 5])
                target.truncate(depth)
            vf = (time.perf_counter() - s) / 8 * 1e3
            print(f"depth {depth} round {r} {name:9s} pp256 {pp:6.2f} tok/s  tg32 {tg:6.2f} tok/s  vf5 {vf:7.1f} ms  "
                  f"tokens {hash(tuple(out)) & 0xffff:04x}", flush=True)
for pipe in pipes.values():
    pipe.close()
