"""MatMulNBits speed by rows M: ONNX Runtime (accuracy level 4 and 1) vs mirrorsd's kernel, on a chain of layers
whose weights exceed the L3 cache, so every call streams them from memory (a decode step in miniature). The default
chain is 59 MB: on a CPU whose L3 is larger (lscpu says so), raise --layers past it (--layers 400 is 590 MB).

    /work/bin/quiet python scripts/lab/kernel_bench.py [--hidden 1536 --inner 1536 --layers 40] [--bits 4]
                                                       [--threads 1,2] [--spinning] [--paths amx,avx512vnni,avx2]

Prints one markdown table: per thread count and kernel, ms per chain call for M = 1..8, the bytes read per call
(weights + scales) / time for M = 1 as GB/s and as a fraction of the copy bandwidth measured in the same run
(mirrorsd.apps.bandwidth), and each M's cost in one-row steps (ms(M) / ms(1)). --paths adds a row per
instruction-set path of mirrorsd's kernel (MIRRORSD_KERNELS_ISA, read when a session creates its kernels). The
weights are random bytes: speed does
not depend on their values. Needs onnx (to write the graph).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import numpy as np

from mirrorsd.apps.bandwidth import copy_bandwidth
from mirrorsd.devices import kernels

BLOCK = 32
KERNELS = {"ort-level4": (kernels.ORT_DOMAIN, 4), "ort-level1": (kernels.ORT_DOMAIN, 1),
           "mirrorsd": (kernels.DOMAIN, 4)}


def chain_model(dims: list[int], bits: int, domain: str, level: int, seed: int = 0) -> tuple[bytes, int]:
    """A chain A -> MatMulNBits(dims[0] -> dims[1]) -> ... ; returns (model bytes, bytes of weights + scales)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x, read = [], [], "A", 0
    for i, (K, N) in enumerate(zip(dims[:-1], dims[1:])):
        kb = -(-K // BLOCK)
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (N, kb, BLOCK * bits // 8), dtype=np.uint8), f"B{i}"))
        inits.append(numpy_helper.from_array((rng.random(N * kb) * 0.01 + 0.001).astype(np.float32), f"S{i}"))
        nodes.append(helper.make_node("MatMulNBits", [x, f"B{i}", f"S{i}"], [f"Y{i}"], domain=domain, K=K, N=N,
                                      bits=bits, block_size=BLOCK, accuracy_level=level))
        read += N * kb * (BLOCK * bits // 8 + 4)
        x = f"Y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", dims[0]])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", dims[-1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    return model.SerializeToString(), read


def session(model: bytes, threads: int, ours: bool, spinning: bool, path: str | None = None):
    import os

    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    # the runtime's sessions do not spin (two sessions share the cores in mirror mode); a worker thread then sleeps
    # between parallel sections, and waking it costs ~15-20 us per node here
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if ours:
        kernels.register(opts)
    saved = os.environ.pop(kernels.ISA_ENV, None)
    if path:
        os.environ[kernels.ISA_ENV] = path
    try:
        return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    finally:
        os.environ.pop(kernels.ISA_ENV, None)
        if saved is not None:
            os.environ[kernels.ISA_ENV] = saved


def time_rows(sess, inputs: dict[int, np.ndarray], repeats: int) -> dict[int, float]:
    """Median ms per call for each row count; the row counts take turns, so drift hits them alike."""
    for a in inputs.values():  # warm-up: first calls touch fresh buffers
        sess.run(None, {"A": a})
    times: dict[int, list[float]] = {m: [] for m in inputs}
    for _ in range(repeats):
        for m, a in inputs.items():
            start = time.perf_counter()
            sess.run(None, {"A": a})
            times[m].append(time.perf_counter() - start)
    return {m: statistics.median(t) * 1e3 for m, t in times.items()}


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--inner", type=int, default=1536, help="layers alternate hidden -> inner -> hidden")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"any of {', '.join(KERNELS)}")
    parser.add_argument("--spinning", action="store_true", help="let ONNX Runtime's worker threads spin")
    parser.add_argument("--paths", default="", help="also time these paths of mirrorsd's kernel, one row each "
                                                    "(e.g. amx,avx512vnni,avx2,scalar)")
    args = parser.parse_args()
    dims = [args.hidden if i % 2 == 0 else args.inner for i in range(args.layers + 1)]
    rows = [int(m) for m in args.rows.split(",")]
    print(f"CPU: {cpu_name()}; chain of {args.layers} int{args.bits} MatMulNBits layers "
          f"({args.hidden}<->{args.inner}); mirrorsd path: {kernels.usable_library().fast_path}; "
          f"worker threads {'spin' if args.spinning else 'sleep'} between nodes")
    header = ["threads", "kernel", "M=1 ms", "GB/s", "of copy bw"] + [f"M={m} ms (steps)" for m in rows[1:]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for threads in (int(t) for t in args.threads.split(",")):
        bandwidth = copy_bandwidth(threads)
        runs = [(name, None) for name in args.kernels.split(",") if name]
        runs += [(f"mirrorsd/{path}", path) for path in args.paths.split(",") if path]
        for name, path in runs:
            domain, level = KERNELS[name.split("/")[0]]
            model, read = chain_model(dims, args.bits, domain, level)
            sess = session(model, threads, domain == kernels.DOMAIN, args.spinning, path)
            rng = np.random.default_rng(1)
            ms = time_rows(sess, {m: rng.standard_normal((m, args.hidden)).astype(np.float32) for m in rows},
                           args.repeats)
            gb_s = read / ms[rows[0]] / 1e6
            cells = [str(threads), name, f"{ms[rows[0]]:.2f}", f"{gb_s:.1f}", f"{gb_s / bandwidth:.2f}"]
            cells += [f"{ms[m]:.2f} ({ms[m] / ms[rows[0]]:.2f})" for m in rows[1:]]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)  # progress; the whole table comes at the end
        print(f"copy bandwidth with {threads} thread(s): {bandwidth:.1f} GB/s (read + write)", flush=True)
    print(f"bytes read per call (weights + scales): {read / 1e6:.1f} MB")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
