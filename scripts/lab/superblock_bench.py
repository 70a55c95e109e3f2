"""The super-block layout of carried Q4_K nodes against the interleaved layout, on a chain of int4 layers whose
scales and zero points have Q4_K's form (random codes, d and dmin fp16, sc and m 6-bit): both sessions in one
process, calls alternated, so both see the same machine.

    python scripts/lab/superblock_bench.py [--hidden 1536] [--inner 8960] [--layers 40] [--threads 2]
                                           [--rows 1,2,5] [--repeats 9]

Prints ms per chain call (median) for each row count and layout. The default chain holds 413 MB in the interleaved
layout (6 bits per weight) and 327 MB in super-blocks (4.75): past the caches, so every call streams it.
MIRRORSD_KERNELS_ISA picks the path (avx512vnni or avx2 have the layout).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kernel_graphs import Layer, model_bytes  # noqa: E402  (the tests' graph builder)


def q4k_form(rng: np.random.Generator, k: int, n: int) -> Layer:
    kb = k // 32
    d = rng.uniform(1e-4, 1e-3, (n, kb // 8)).astype(np.float16).astype(np.float32)
    dmin = rng.uniform(1e-4, 1e-3, (n, kb // 8)).astype(np.float16).astype(np.float32)
    sc = rng.integers(1, 64, (n, kb // 8, 8)).astype(np.float32)
    m = rng.integers(0, 64, (n, kb // 8, 8)).astype(np.float32)
    sc[..., 0] = m[..., 0] = 63  # GGUF's quantizer gives each super-block's largest sc and m the value 63
    scales = (d[..., None] * sc).reshape(n, kb).astype(np.float32)
    zero_points = ((dmin[..., None] * m).reshape(n, kb) / scales).astype(np.float32)
    codes = rng.integers(0, 256, (n, kb, 16), dtype=np.uint8)
    return Layer(codes, scales.reshape(-1), np.empty((k, n), np.float32), None, 4, zero_points.reshape(-1))


def session(model: bytes, threads: int, superblocks: bool):
    import onnxruntime as ort

    from mirrorsd.devices import kernels
    from mirrorsd.devices.backends import SPINNING_POOL

    os.environ["MIRRORSD_KERNELS_SUPERBLOCKS"] = "1" if superblocks else "0"  # read when the session packs B
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = threads, 3
    for key, value in SPINNING_POOL:
        opts.add_session_config_entry(key, value)
    kernels.register(opts)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--inner", type=int, default=8960)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,5")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    layers = [q4k_form(rng, *((args.hidden, args.inner) if i % 2 == 0 else (args.inner, args.hidden)))
              for i in range(args.layers)]
    from mirrorsd.devices import kernels

    model = model_bytes(layers, kernels.DOMAIN)
    sessions = {"interleaved": session(model, args.threads, False), "super-blocks": session(model, args.threads, True)}
    print(f"{args.layers} layers {args.hidden} <-> {args.inner}, {args.threads} threads, "
          f"{sum(layer.B.nbytes for layer in layers) * 1.5 / 1e6:.0f} MB interleaved")
    print("| rows | interleaved ms | super-blocks ms | ratio |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        a = rng.standard_normal((rows, args.hidden)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for r in range(args.repeats):
            order = list(sessions.items()) if r % 2 == 0 else list(reversed(sessions.items()))
            for name, s in order:
                start = time.perf_counter()
                s.run(None, {"A": a})
                times[name].append(time.perf_counter() - start)
        old, new = (statistics.median(times[name]) * 1e3 for name in sessions)
        print(f"| {rows} | {old:.2f} | {new:.2f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
