"""Where the target's time goes at a given depth: ONNX Runtime's profiler over the prefix and suffix graphs, summed per
op type, for one 256-token chunk (pp256) and per one-row step (16 greedy steps), after DEPTH cached tokens.

    python scripts/lab/target_op_profile.py EXPORT DEPTH                e.g. exports/qwen-int4 4096
    KV_IN_PLACE=0 python scripts/lab/target_op_profile.py ...           the exported graphs' Concat cache

Writes ONNX Runtime's JSON traces into a temporary folder and deletes them.
"""
import collections, json, os, sys, tempfile, time
from pathlib import Path

import mirrorsd.devices.backends as backends

trace_dir = tempfile.mkdtemp(prefix="mirrorsd-profile-")
_options = backends.OrtSession._options


def _profiled(settings):
    opts = _options(settings)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(trace_dir) / "ort")
    return opts


backends.OrtSession._options = staticmethod(_profiled)
from mirrorsd.devices.placement import DeviceRequest  # noqa: E402
from mirrorsd.runtime import Pipeline  # noqa: E402
from mirrorsd.runtime.verify import greedy_tokens  # noqa: E402

depth, steps = int(sys.argv[2]), 16
request = DeviceRequest(spin_in_run=True, target_kv_in_place=os.environ.get("KV_IN_PLACE", "1") == "1")
with Pipeline.load(sys.argv[1], request) as pipe:
    print(pipe.placement, flush=True)
    text = [1000 + (i * 7919) % 50000 for i in range(depth + 300)]
    pipe.target.reset(1, depth + 300)
    if depth:
        pipe.target.prefill(text[:depth])
    start = time.perf_counter()
    pipe.target.extend(text[depth:depth + 256])
    print(f"pp256 {256 / (time.perf_counter() - start):.2f} tok/s")
    pipe.target.truncate(depth)
    token, start = text[depth], time.perf_counter()
    for _ in range(steps):
        token = int(greedy_tokens(pipe.target.extend([token]))[-1])
    print(f"tg{steps} {steps / (time.perf_counter() - start):.2f} tok/s")
    traces = [pipe.target.prefix.backend.session.end_profiling(), pipe.target.suffix.backend.session.end_profiling()]
for label, picked, count in (("pp256", slice(-steps - 1, -steps), 1), ("per step", slice(-steps, None), steps)):
    per_op = collections.Counter()
    for trace in traces:
        events = json.load(open(trace))
        runs = [e for e in events if e.get("name") == "model_run"][picked]
        lo, hi = runs[0]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
        for e in events:
            if e.get("cat") == "Node" and lo <= e["ts"] <= hi and e["name"].endswith("_kernel_time"):
                per_op[e["args"].get("op_name")] += e["dur"]
    print(label + ": " + ", ".join(f"{op} {us / count / 1000:.1f} ms" for op, us in per_op.most_common(8)))
for trace in traces:
    os.remove(trace)
os.rmdir(trace_dir)
