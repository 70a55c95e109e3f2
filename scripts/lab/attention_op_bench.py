"""mirrorsd's InPlaceAttention op alone against the graph's attention nodes on ONNX Runtime (Transpose, MatMul, Add,
Softmax, MatMul), one-node graphs, random inputs, best of 6 rounds alternated: ms per layer and GFLOP/s for a few
(rows, cached slots) shapes of the Qwen2.5-Coder-1.5B target (12 query heads, 2 KV heads, head size 128).

    python scripts/lab/attention_op_bench.py [THREADS]
"""
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from mirrorsd.devices import kernels
from mirrorsd.devices.backends import SPINNING_POOL

H, KVH, D = 12, 2, 128
THREADS = int(sys.argv[1]) if len(sys.argv) > 1 and __name__ == "__main__" else 2


def session(nodes, inputs, opsets, register):
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                   for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    for key, value in SPINNING_POOL:  # as the runtime's pools: spin within a run only (see attention_lib_ab.py)
        opts.add_session_config_entry(key, value)
    if register:
        kernels.register(opts, allow_slow=True)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ours():
    names = ["q", "k", "v", "cos", "sin", "mask"] + [f"key{h}" for h in range(KVH)] + [f"value{h}" for h in range(KVH)]
    node = helper.make_node("InPlaceAttention", names, ["y"], domain=kernels.DOMAIN, num_heads=H, kv_num_heads=KVH,
                            scale=D ** -0.5)
    return session([node], names, [("", 17), (kernels.DOMAIN, 1)], True)


def graphs():
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Add", ["s", "mask"], ["m"]), helper.make_node("Softmax", ["m"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    return session(nodes, ["q", "k", "v", "mask"], [("", 17)], False)


def op_feeds(rng, rows: int, past: int) -> dict:
    """Random inputs of InPlaceAttention for `rows` new rows after `past` cached slots (views of past + rows slots)."""
    slots = past + rows
    feeds = {"q": rng.standard_normal((1, rows, H * D), np.float32),
             "k": rng.standard_normal((1, rows, KVH * D), np.float32),
             "v": rng.standard_normal((1, rows, KVH * D), np.float32),
             "cos": np.ones((1, rows, D), np.float32), "sin": np.zeros((1, rows, D), np.float32),
             "mask": np.zeros((1, 1, rows, slots), np.float32)}
    for h in range(KVH):
        feeds[f"key{h}"] = rng.standard_normal((1, 1, slots, D)).astype(np.float32)
        feeds[f"value{h}"] = rng.standard_normal((1, 1, slots, D)).astype(np.float32)
    return feeds


def main() -> None:
    rng = np.random.default_rng(0)
    for rows, past in [(1, 8192), (5, 8192), (256, 8192), (256, 0)]:
        slots = past + rows
        mine = op_feeds(rng, rows, past)
        group = H // KVH
        theirs = {"q": rng.standard_normal((1, KVH, group * rows, D), np.float32),
                  "k": rng.standard_normal((1, KVH, slots, D), np.float32),
                  "v": rng.standard_normal((1, KVH, slots, D), np.float32),
                  "mask": np.zeros((1, 1, group * rows, slots), np.float32)}
        runs = [(ours(), mine), (graphs(), theirs)]
        calls = 2 if rows > 1 else 20
        best = [float("inf")] * 2
        for _ in range(6):
            for i, (sess, feeds) in enumerate(runs):
                sess.run(None, feeds)
                start = time.perf_counter()
                for _ in range(calls):
                    sess.run(None, feeds)
                best[i] = min(best[i], (time.perf_counter() - start) / calls)
        flops = 2 * 2 * H * rows * slots * D
        print(f"rows {rows:3d} after {past:5d} slots: InPlaceAttention {best[0] * 1e3:7.2f} ms "
              f"({flops / best[0] / 1e9:5.1f} GFLOP/s)  graph nodes {best[1] * 1e3:7.2f} ms "
              f"({flops / best[1] / 1e9:5.1f})", flush=True)


if __name__ == "__main__":
    main()
