"""devices/heap.py: glibc keeps freed chunks resident until malloc_trim gives their pages back, and OpenVINO CPU
sessions with dynamic shapes trim every few calls (the cause of the OpenVINO draft's RSS growth across 10k-token
runs; tests/test_long_run.py measures the whole run)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mirrorsd.devices.heap import MALLOC_TRIM, TRIM_EVERY, HeapTrimmer, trim_heap

from markers import needs_openvino

MiB = 2**20
needs_glibc = pytest.mark.skipif(MALLOC_TRIM is None, reason="no glibc malloc_trim in this process (not Linux/glibc)")


@needs_glibc
def test_trim_releases_free_chunks_that_free_kept_resident():
    """2048 touched 64 KiB chunks, every other one freed: the live ones keep the freed ones from merging or reaching
    the top of the heap (where free would return them), so their 64 MiB stay resident until malloc_trim(0)."""
    import psutil

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    rss = psutil.Process().memory_info
    chunks = []
    try:
        for _ in range(2048):
            chunks.append(libc.malloc(64 * 1024))  # below the mmap threshold: from the heap
            ctypes.memset(chunks[-1], 1, 64 * 1024)  # touched: resident
        before = rss().rss
        for pointer in chunks[0::2]:  # the last one (odd index) stays: the heap's top is live
            libc.free(pointer)
        chunks = chunks[1::2]
        freed = rss().rss
        assert before - freed < 16 * MiB, "free gave the pages back by itself: the premise of devices/heap.py is gone"
        assert trim_heap()
        trimmed = rss().rss
        assert freed - trimmed > 48 * MiB, (before / MiB, freed / MiB, trimmed / MiB)
    finally:
        for pointer in chunks:
            libc.free(pointer)


def test_trimmer_counts_calls():
    trimmer = HeapTrimmer(every=3)
    for _ in range(7):
        trimmer.after_call()
    assert trimmer.calls == 7
    assert trimmer.trims == (2 if MALLOC_TRIM is not None else 0) and trimmer.seconds >= 0


@needs_openvino
def test_openvino_cpu_sessions_with_dynamic_shapes_trim(exported):
    """A dynamic-shape CPU session trims every TRIM_EVERY calls (fixed-shape sessions, an NPU's way, meet few shapes
    and have no trimmer: ``heap`` is None unless ``tuned``)."""
    from mirrorsd.devices.backends import OpenVINOSession, SessionSettings

    path = exported("llama", draft_layers=2) / "draft.onnx"
    dynamic = OpenVINOSession(path, SessionSettings("CPU", 1, "f32"))
    heads, dim = 2, 16  # the tiny llama's KV heads and head size (tests/tiny_models.py)
    for past in range(2 * TRIM_EVERY):  # a new shape every call, as in decoding
        kv = np.zeros((1, heads, past, dim), np.float32)
        feeds = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, past + 1), np.int64),
                 "position_ids": np.array([[past]]),
                 **{f"past_key_values.{i}.{kind}": kv for i in range(2) for kind in ("key", "value")}}
        assert dynamic.run(feeds)["logits"].shape == (1, 1, 384)
    assert dynamic.heap.calls == 2 * TRIM_EVERY
    assert dynamic.heap.trims == (2 if MALLOC_TRIM is not None else 0)
