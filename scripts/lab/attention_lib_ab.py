"""Two builds of mirrorsd's kernels library, InPlaceAttention alone in each, alternated in one process, per (rows,
cached slots) shape of the Qwen2.5-Coder-1.5B target (12 query heads, 2 KV heads, head size 128): ms per call (best
of 6 rounds), and whether the two give the same bits. Build each variant with `python -m mirrorsd.devices.kernels`
(it prints the library's path; the cache keeps one per source hash).

    python scripts/lab/attention_lib_ab.py BEFORE.so AFTER.so [THREADS (2)] [LAYERS (1)] [SHAPES]

LAYERS > 1 gives each shape that many layers' worth of distinct buffers, called in turn, so the cache is read from
memory as in a decoding step (with one, a shape's 16 MB at 8192 slots stays in a 32 MB L3): then ms per layer, the
median of 11 rounds whose build order alternates. SHAPES: ROWSxSLOTS[,...] (default 1x8192,5x8192,1x1000,5x1000,
256x8192,256x0).
"""
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).parent))
from attention_op_bench import D, H, KVH, op_feeds  # noqa: E402

from mirrorsd.devices.backends import SPINNING_POOL  # noqa: E402

LIBS = {"before": sys.argv[1], "after": sys.argv[2]}
THREADS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
LAYERS = int(sys.argv[4]) if len(sys.argv) > 4 else 1
SHAPES = sys.argv[5] if len(sys.argv) > 5 else "1x8192,5x8192,1x1000,5x1000,256x8192,256x0"
NAMES = ["q", "k", "v", "cos", "sin", "mask"] + [f"key{h}" for h in range(KVH)] + [f"value{h}" for h in range(KVH)]


def session(library: str):
    node = helper.make_node("InPlaceAttention", NAMES, ["y"], domain="mirrorsd.kern", num_heads=H, kv_num_heads=KVH,
                            scale=D ** -0.5)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                    for n in NAMES],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mirrorsd.kern", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    for key, value in SPINNING_POOL:  # spin within a run, as the runtime's pools do; left spinning after a run (ONNX
        opts.add_session_config_entry(key, value)  # Runtime's default), one build's threads slowed the other's calls
    opts.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


rng = np.random.default_rng(0)
sessions = {name: session(path) for name, path in LIBS.items()}
for rows, past in [tuple(int(n) for n in shape.split("x")) for shape in SHAPES.split(",")]:
    if LAYERS == 1:
        feeds = [op_feeds(rng, rows, past)]
        calls, rounds = (2 if rows > 100 else 20), 6
    else:
        feeds = [op_feeds(rng, rows, past) for _ in range(LAYERS if rows < 100 else min(LAYERS, 4))]
        calls, rounds = 1, 11
    times = {name: [] for name in sessions}
    for i in range(rounds):
        for name in list(sessions) if i % 2 == 0 else list(sessions)[::-1]:
            if LAYERS == 1:
                sessions[name].run(None, feeds[0])
            start = time.perf_counter()
            for _ in range(calls):
                for f in feeds:
                    sessions[name].run(None, f)
            times[name].append((time.perf_counter() - start) / (calls * len(feeds)))
    took = {n: min(t) if LAYERS == 1 else sorted(t)[len(t) // 2] for n, t in times.items()}
    # the views are written in place: both ran on the same feeds, so their outputs compare
    outputs = [sess.run(None, feeds[0])[0] for sess in sessions.values()]
    print(f"rows {rows:3d} after {past:5d} slots: " + "  ".join(f"{n} {v * 1e3:7.3f} ms" for n, v in took.items())
          + f"  ratio {took['after'] / took['before']:.3f}  same bits {bool(np.array_equal(*outputs))}", flush=True)
