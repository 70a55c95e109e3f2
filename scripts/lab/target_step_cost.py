"""What one target forward costs, by window width and context length: the terms of the SD step-time model.

    python scripts/lab/target_step_cost.py EXPORT_DIR [--contexts 128,512,1024,2048,4096] [--widths 1,2,3,4,5] [--kernels auto]
                                                  [--threads 2] [--device cpu] [--repeats 7]

Prefills random token ids up to each context length (growing one cache), then times a forward of W new tokens at
that length (median of --repeats; the cache is truncated back after each), for every W. Prints ms per forward, the
cost of W rows in one-row steps (the verification cost of a window of gamma + 1 = W), and the KV bytes a step reads.
Then the bandwidth ceilings of one step (the target's weight bytes / the copy bandwidth, and / the read-only stream's
bandwidth, measured now with --threads threads: mirrorsd.apps.bandwidth) and each context's one-row step as a fraction
of each (ceiling ms / W=1 ms). The kernel
path is the one the library picks, or the one MIRRORSD_KERNELS_ISA names.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from mirrorsd.apps.bandwidth import copy_bandwidth, read_bandwidth, target_weight_bytes
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.models import TargetModel

PREFILL_CHUNK = 256  # prefill in pieces: one 4k-token forward would hold a [4k, 4k] score matrix per head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--contexts", default="128,512,1024,2048,4096")
    parser.add_argument("--widths", default="1,2,3,4,5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", choices=("auto", "mirrorsd", "ort"), default="auto",
                        help="whose MatMulNBits kernel ONNX Runtime CPU sessions run (as for generate)")
    parser.add_argument("--cache", choices=("present", "buffer"), default="present",
                        help="the target's KV cache: the graphs' presents (shipped) or a preallocated buffer (before)")
    args = parser.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(","))
    widths = [int(w) for w in args.widths.split(",")]
    request = DeviceRequest(target=args.device, draft="cpu", target_threads=args.threads, draft_threads=1,
                            kernels=args.kernels)
    rng = np.random.default_rng(0)
    with Pipeline.load(args.folder, request) as pipe:
        target, info = pipe.target, pipe.manifest.target
        if args.cache == "buffer":
            target = TargetModel(target.prefix, target.exit_head, target.suffix, cache="buffer")
        kv_per_slot = info.num_layers * 2 * info.num_kv_heads * info.head_dim * 4  # keys + values, float32
        ids = rng.integers(100, min(info.vocab_size, 30000), size=max(contexts) + max(widths)).tolist()
        target.reset(1, max(contexts) + max(widths) + 8)
        path = os.environ.get("MIRRORSD_KERNELS_ISA") or _picked_path()
        print(f"CPU: {_cpu_name()}; {args.threads} thread(s); --kernels {args.kernels} (mirrorsd path: {path})")
        one_row = {}
        print(f"| context | {' | '.join(f'W={w} ms' for w in widths)} | "
              f"{' | '.join(f'W={w}/W=1' for w in widths[1:])} | KV read per step |")
        print("|---" * (2 * len(widths) + 1) + "|")
        for context in contexts:
            while target.length < context:
                take = min(PREFILL_CHUNK, context - target.length)
                target.extend(ids[target.length: target.length + take])
            ms = {w: _median_ms(target, ids[context: context + w], args.repeats) for w in widths}
            ratios = " | ".join(f"{ms[w] / ms[widths[0]]:.2f}" for w in widths[1:])
            print(f"| {context} | {' | '.join(f'{ms[w]:.1f}' for w in widths)} | {ratios} | "
                  f"{kv_per_slot * context / 1e6:.0f} MB |", flush=True)
            one_row[context] = ms[widths[0]]
        weights = target_weight_bytes(args.folder, pipe.manifest)
    for name, bandwidth in (("copy", copy_bandwidth(args.threads)), ("read-only", read_bandwidth(args.threads))):
        ceiling_ms = weights / (bandwidth * 1e9) * 1e3
        print(f"{name} ceiling: {weights / 1e9:.2f} GB of weights per step / {bandwidth:.1f} GB/s {name} bandwidth "
              f"({args.threads} thread(s)) = {ceiling_ms:.1f} ms per step; "
              + "; ".join(f"context {c}: W={widths[0]} step at {ceiling_ms / ms:.2f} of it" for c, ms in one_row.items()))


def _picked_path() -> str:
    from mirrorsd.errors import KernelsUnavailableError
    from mirrorsd.devices import kernels

    try:
        return kernels.usable_library().fast_path or "none"
    except KernelsUnavailableError:
        return "none"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def _median_ms(target, window: list[int], repeats: int) -> float:
    base = target.length
    times = []
    for _ in range(repeats + 1):  # the first run warms the shapes up and is dropped
        start = time.perf_counter()
        target.extend(window)
        times.append(time.perf_counter() - start)
        target.truncate(base)
    return 1e3 * statistics.median(times[1:])


if __name__ == "__main__":
    main()
