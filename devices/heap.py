"""Freed heap pages back to the system (glibc's ``malloc_trim``), for OpenVINO's CPU plugin on dynamic shapes.

With a KV cache every draft step feeds a new input shape (the past grows by the tokens committed). OpenVINO's CPU
plugin then allocates its outputs and the buffers it sized for the old shape anew, and the Python binding copies
the outputs into new arrays; the old buffers go back to glibc's heap. None of this leaks: over repeated identical
long Mirror-SD runs in one process the bytes glibc reports in use stayed the same after each run, while its heaps
held hundreds of MiB of free chunks whose pages stayed resident (docs/reliability.md has the measurement). Which of
those a later run could reuse depended on the timing of the two threads, so the RSS sometimes stayed flat and
sometimes grew run after run. glibc gives memory back on ``free`` only from the top of a heap; ``malloc_trim(0)``
also releases every whole free page inside one (madvise), and nothing else changes: the allocations stay where they
are, the released pages read as zero when reused.

So an OpenVINO session with dynamic shapes on the CPU trims every ``TRIM_EVERY`` calls: often enough that what a
run frees cannot pile up, rarely enough that the trims cost little (the draft's time in them is reported by
``HeapTrimmer.seconds``; the measurement is in docs/reliability.md). Where there is no glibc (Windows, macOS,
musl), ``malloc_trim`` is not found and the trimmer does nothing.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

# draft calls between two trims; a 10k-token Mirror-SD run makes ~10,300 of them (docs/reliability.md)
TRIM_EVERY = 32


def _find_malloc_trim():
    """glibc's ``int malloc_trim(size_t pad)`` from the C library this process already runs, or None."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # dlopen(NULL): the symbols the process has loaded
    except (OSError, AttributeError, TypeError):  # no such symbol, or no dlopen(NULL) (Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


MALLOC_TRIM = _find_malloc_trim()


def trim_heap() -> bool:
    """Release the free pages of every malloc heap to the system; whether there was anything to do it with."""
    if MALLOC_TRIM is None:
        return False
    MALLOC_TRIM(0)
    return True


@dataclass
class HeapTrimmer:
    """Counts a session's calls and trims the heap after every ``every``-th; ``trims`` and ``seconds`` say what it
    did and what that cost."""

    every: int = TRIM_EVERY
    calls: int = 0
    trims: int = 0
    seconds: float = 0.0

    def after_call(self) -> None:
        self.calls += 1
        if self.calls % self.every:
            return
        began = time.perf_counter()
        if trim_heap():
            self.trims += 1
            self.seconds += time.perf_counter() - began
