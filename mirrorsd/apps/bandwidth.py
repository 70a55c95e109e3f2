"""The memory-bandwidth ceiling of autoregressive decoding: weight bytes read per token ÷ bytes per second.

One decode step reads every weight of the target once (a matrix-vector product per layer), so on a CPU
``tokens/s <= bandwidth / weight bytes``. ``mirrorsd bench`` measures the bandwidth in the same run, two ways, best of
a few repeats per thread count, and reports ``ar``'s decode speed as a fraction of each ceiling:

- a STREAM-style copy, counting bytes read + bytes written per second (the figure the notes have always quoted);
- a read-only stream (a maximum over a float32 buffer), which is what a decode step does to its weights. On some
  virtual machines a copy's read + write total is ~1.4x what a read-only stream reaches (a 2-core Xeon VM: copy
  31-34 GB/s, read-only 23 GB/s with 2 threads), so the copy ceiling understates how close a step is to the memory.
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
    read_gb_s: float = 0.0  # read-only stream, bytes read / s (0: not measured)

    @property
    def read_tokens_per_second(self) -> float:
        """The ceiling from the read-only stream: read bandwidth / weight bytes (0 when it was not measured)."""
        return self.read_gb_s / self.weight_gb_per_token if self.weight_gb_per_token else 0.0


def copy_bandwidth(threads: int = 1, megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s moved by ``threads`` threads, each copying its own ``megabytes`` buffer (NumPy releases the GIL)."""
    n = megabytes * 2**20 // 8
    sources = [np.ones(n, np.float64) for _ in range(threads)]
    targets = [np.empty_like(s) for s in sources]
    # each byte is read once and written once
    return _timed_by_threads(threads, lambda i: np.copyto(targets[i], sources[i]), 2 * n * 8, repeats)


def _timed_by_threads(threads: int, work, bytes_each: int, repeats: int) -> float:
    """GB/s of ``work(i)`` run by ``threads`` threads at once (each on its own data), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def run(i: int) -> None:
            barrier.wait()
            work(i)

        pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        best = min(best, time.perf_counter() - start)
    return bytes_each * threads / best / 1e9


def read_bandwidth(threads: int = 1, megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s read by ``threads`` threads, each taking the maximum of its own ``megabytes`` float32 buffer (a
    vectorized pass that reads every byte once and writes nothing; NumPy releases the GIL)."""
    n = megabytes * 2**20 // 4
    buffers = [np.ones(n, np.float32) for _ in range(threads)]
    return _timed_by_threads(threads, lambda i: buffers[i].max(), n * 4, repeats)


def target_weight_bytes(folder: Path, manifest: Manifest, kernel_layout: bool = True) -> int:
    """Bytes of the target graphs a decode step reads: prefix + suffix files (with external data; a graph with packed
    weights counted as unpacked, devices/unpack.py), less the embedding table as stored (float, or quantized:
    export/embedding.py), which is gathered (one row per token), not read whole. The exit head is not counted (ar
    does not run it). ``kernel_layout``: less what mirrorsd's kernel, when sessions here use it, does not stream
    (carried Q4_K nodes in its super-block layout: devices/kernels/superblocks.py)."""
    from mirrorsd.devices.unpack import unpacked_bytes
    from mirrorsd.export.embedding import stored_bytes

    total = saved = 0
    packed = manifest.export_options.get("weight_storage") == "packed"
    library = _superblock_library() if kernel_layout else None
    for role in ("prefix", "suffix"):
        path = Path(folder) / manifest.graph(role).file
        unpacked = unpacked_bytes(path) if packed else None  # packed weights: what a session holds, not the file
        total += len(unpacked) if unpacked is not None else 0
        for file in (path, path.with_name(path.name + ".data")):
            if file.is_file() and (unpacked is None or file != path):
                total += file.stat().st_size
        if library is not None:
            saved += _superblock_savings(path, unpacked, library)
    width = 2 if manifest.export_options.get("target_precision") == "fp16" else 4  # unless counted as quantized
    embedding = stored_bytes(manifest.graph("prefix").validation, manifest.target.vocab_size,
                             manifest.target.hidden_size, width)
    return max(total - embedding - saved, 1)


def _superblock_library():
    """The kernel library when sessions created now pack carried Q4_K nodes in super-blocks, else None."""
    from mirrorsd.devices import kernels
    from mirrorsd.devices.kernels import superblocks

    try:
        library = kernels.usable_library()
    except kernels.KernelsUnavailableError:
        return None
    return library if superblocks.in_use(library) else None


def _superblock_savings(path: Path, unpacked: bytes | None, library) -> int:
    import mmap

    from mirrorsd.devices.kernels import superblocks

    if unpacked is not None:
        return superblocks.bytes_saved(unpacked, path.parent, library)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return superblocks.bytes_saved(buf, path.parent, library)


def ceilings(folder: Path, manifest: Manifest, thread_counts: tuple[int, ...]) -> list[Ceiling]:
    weights = target_weight_bytes(folder, manifest)
    out = []
    for threads in thread_counts:
        bandwidth = copy_bandwidth(threads)
        out.append(Ceiling(threads, bandwidth, weights / 1e9, bandwidth * 1e9 / weights, read_bandwidth(threads)))
    return out
