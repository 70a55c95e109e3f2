"""The memory-bandwidth ceiling of autoregressive decoding: weight bytes read per token ÷ bytes per second.

One decode step reads every weight of the target once (a matrix-vector product per layer), so on a CPU
``tokens/s <= bandwidth / weight bytes``. ``mirrorsd bench`` measures the bandwidth in the same run (a STREAM-style
copy: bytes read + bytes written per second, best of a few repeats, per thread count) and reports ``ar``'s decode
speed as a fraction of that ceiling.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirrorsd.manifest import Manifest


@dataclass(frozen=True)
class Ceiling:
    threads: int
    bandwidth_gb_s: float  # copy bandwidth, (read + written bytes) / s
    weight_gb_per_token: float
    tokens_per_second: float  # bandwidth / weight bytes


def copy_bandwidth(threads: int = 1, megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s moved by ``threads`` threads, each copying its own ``megabytes`` buffer (NumPy releases the GIL)."""
    n = megabytes * 2**20 // 8
    sources = [np.ones(n, np.float64) for _ in range(threads)]
    targets = [np.empty_like(s) for s in sources]
    best = float("inf")
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def work(i: int) -> None:
            barrier.wait()
            np.copyto(targets[i], sources[i])

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 8 * threads / best / 1e9  # each byte is read once and written once


def target_weight_bytes(folder: Path, manifest: Manifest) -> int:
    """Bytes of the target graphs a decode step reads: prefix + suffix files (with external data), less the
    embedding table as stored (float, or quantized: export/embedding.py), which is gathered (one row per token),
    not read whole. The exit head is not counted (ar does not run it)."""
    from mirrorsd.export.embedding import stored_bytes

    total = 0
    for role in ("prefix", "suffix"):
        path = Path(folder) / manifest.graph(role).file
        for file in (path, path.with_name(path.name + ".data")):
            if file.is_file():
                total += file.stat().st_size
    width = 2 if manifest.export_options.get("target_precision") == "fp16" else 4  # unless counted as quantized
    embedding = stored_bytes(manifest.graph("prefix").validation, manifest.target.vocab_size,
                             manifest.target.hidden_size, width)
    return max(total - embedding, 1)


def ceilings(folder: Path, manifest: Manifest, thread_counts: tuple[int, ...]) -> list[Ceiling]:
    weights = target_weight_bytes(folder, manifest)
    out = []
    for threads in thread_counts:
        bandwidth = copy_bandwidth(threads)
        out.append(Ceiling(threads, bandwidth, weights / 1e9, bandwidth * 1e9 / weights))
    return out
