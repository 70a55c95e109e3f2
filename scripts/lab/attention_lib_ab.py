"""Two builds of mirrorsd's kernels library, InPlaceAttention alone in each, alternated in one process: best of 6
rounds per (rows, cached slots) shape of the Qwen2.5-Coder-1.5B target (12 query heads, 2 KV heads, head size 128),
and whether the two give the same bits. Build each variant with `python -m mirrorsd.devices.kernels` (it prints the
library's path; the cache keeps one per source hash).

    python scripts/lab/attention_lib_ab.py BEFORE.so AFTER.so [THREADS]
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
for rows, past in [(1, 8192), (5, 8192), (1, 1000), (5, 1000), (256, 8192), (256, 0)]:
    feeds = op_feeds(rng, rows, past)
    sessions = {name: session(path) for name, path in LIBS.items()}
    calls = 2 if rows > 100 else 20
    best = {name: float("inf") for name in sessions}
    for _ in range(6):
        for name, sess in sessions.items():
            sess.run(None, feeds)
            start = time.perf_counter()
            for _ in range(calls):
                sess.run(None, feeds)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    # the views are written in place: both ran on the same feeds, so their outputs compare
    outputs = [sess.run(None, feeds)[0] for sess in sessions.values()]
    print(f"rows {rows:3d} after {past:5d} slots: " + "  ".join(f"{n} {v * 1e3:7.2f} ms" for n, v in best.items())
          + f"  same bits {bool(np.array_equal(*outputs))}", flush=True)
