"""The target alone at a given depth (cached tokens), as `llama-bench -d DEPTH -p 256 -n 32` measures llama.cpp:
pp256 (one 256-token chunk after DEPTH cached tokens) and tg32 (32 one-token steps after them, greedy argmax each).

    python scripts/lab/target_depth_rate.py EXPORT DEPTHS          e.g. exports/qwen-int4 0,8192
    FUSE_TARGET=1 python scripts/lab/target_depth_rate.py ...       the draft's fused attention (GroupedAttention,
                                                                     devices/kernels) put into the target's graphs too
    TARGET_DEVICE=openvino:CPU python scripts/lab/target_depth_rate.py ...   the target on OpenVINO's CPU plugin (its
                                                                     default tuning: stateful, fused attention, f16 KV)
    KV_IN_PLACE=0 python scripts/lab/target_depth_rate.py ...      the target's graphs as exported (Concat of the past
                                                                     into new presents each step), not the in-place KV
"""
import os, sys, time
if os.environ.get("FUSE_TARGET") == "1":  # lab: the draft's fused attention on the target's graphs too
    import mirrorsd.devices.placement as pl
    _orig = pl.SessionSettings
    def _patched(*a, **k):
        k["fuse_attention"] = True
        return _orig(*a, **k)
    pl.SessionSettings = _patched
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.verify import greedy_tokens
depths = [int(d) for d in sys.argv[2].split(",")]
with Pipeline.load(sys.argv[1], DeviceRequest(target=os.environ.get("TARGET_DEVICE", "auto"), spin_in_run=True,
                                                 target_kv_in_place=os.environ.get("KV_IN_PLACE", "1") == "1")) as pipe:
    print(pipe.placement if hasattr(pipe, "placement") else "", flush=True)
    text = [1000 + (i * 7919) % 50000 for i in range(max(depths) + 300)]
    for depth in depths:
        pipe.target.reset(1, depth + 300)
        s = time.perf_counter()
        if depth:
            pipe.target.prefill(text[:depth])
        fill = time.perf_counter() - s
        s = time.perf_counter(); pipe.target.extend(text[depth:depth + 256]); pp = 256 / (time.perf_counter() - s)
        pipe.target.truncate(depth)
        tok = text[depth]
        s = time.perf_counter()
        for _ in range(32):
            tok = int(greedy_tokens(pipe.target.extend([tok]))[-1])
        tg = 32 / (time.perf_counter() - s)
        print(f"depth {depth}: prefill {fill:.1f} s ({depth / fill if depth else 0:.1f} tok/s), pp256 {pp:.2f} tok/s, tg32 {tg:.2f} tok/s", flush=True)
