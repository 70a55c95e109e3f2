"""One graph file against another, one-row forwards interleaved in one process: whether they compute the same bits,
and what each costs. For load-free graph changes (export passes) that must leave every output equal.

    python scripts/lab/graph_ab.py PAST FILE_A FILE_B [...] [--rounds 60]

Feeds batch 1, one new token and PAST cached slots (random KV, all slots visible), ONNX Runtime CPU with mirrorsd's
MatMulNBits kernel and 2 threads spinning within a run (as `mirrorsd generate` opens ar and sd sessions). Prints the
max |difference| of the first output against FILE_A's (0.0 = bitwise equal) and each file's median and 25th-percentile
milliseconds per forward.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _session(path: str, threads: int, profile_prefix: str | None = None):
    """A session as mirrorsd opens ar's: its kernels, ``threads`` spinning within a run; with ONNX Runtime's
    profiler on when ``profile_prefix`` is given (op_profile.py)."""
    import onnxruntime as ort

    from mirrorsd.devices import kernels
    from mirrorsd.devices.backends import SPINNING_POOL

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    for key, value in SPINNING_POOL:
        opts.add_session_config_entry(key, value)
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    kernels.register(opts, replace=True)
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _feeds(session, past: int, width: int = 1) -> dict:
    """Batch 1, ``width`` new rows after ``past`` cached slots (random KV, every slot visible)."""
    rng = np.random.default_rng(0)
    dims = {"batch_size": 1, "sequence_length": width, "past_sequence_length": past,
            "total_sequence_length": past + width}
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else dims[d] for d in spec.shape]
        if spec.type == "tensor(int64)":
            if spec.name == "attention_mask":
                feeds[spec.name] = np.ones(shape, np.int64)
            elif spec.name == "position_ids":
                feeds[spec.name] = (past + np.arange(width, dtype=np.int64)).reshape(shape)
            else:
                feeds[spec.name] = rng.integers(100, 1000, shape).astype(np.int64)
        else:
            feeds[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("past", type=int)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sessions = [_session(f, args.threads) for f in args.files]
    feeds = _feeds(sessions[0], args.past)
    first = [s.run(None, feeds)[0] for s in sessions]
    print("max |diff| against the first file:", [float(np.abs(o - first[0]).max()) for o in first])
    times = [[] for _ in sessions]
    for _ in range(args.rounds):
        for k, session in enumerate(sessions):
            start = time.perf_counter()
            session.run(None, feeds)
            times[k].append(time.perf_counter() - start)
    for path, t in zip(args.files, times):
        print(f"{path:48s} median {1e3 * np.median(t):6.2f} ms  p25 {1e3 * np.percentile(t, 25):6.2f} ms")


if __name__ == "__main__":
    main()
