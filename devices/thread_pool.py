"""One ONNX Runtime thread pool shared by every CPU session of the process (``DeviceRequest.shared_pool``,
``--shared-pool``; mode auto takes it where its profile predicts it faster, runtime/planner/threads.py).

With a pool per session, each ONNX Runtime session owns threads of its own. A pipeline holds four to six CPU
sessions (prefix, exit head, suffix, draft, ...) and ar and sd run them one after another. The CLI opens those pools
spinning within a run and stopping at its end for every mode but mirror (devices/backends.py SPINNING_POOL), so they
do not wake sleeping threads for each parallel section; before that policy, the shared pool's threads, which spin
between calls, were what made ar and sd faster on the 2-core machines measured (docs/performance.md). Spinning
threads of *separate* pools that keep spinning after their runs compete instead, which made per-session pools with
spinning on alone much slower (docs/lab-notes/performance-log.md, the shared thread pool).

The pool is the process's, and ONNX Runtime holds a process to it: it takes the pool's size once, and once the pool
exists it refuses to open a session with threads of its own ("use_per_session_threads must be false when using a
global thread pool"). So the pool is opt-in (a library may open pipelines with other thread counts in one process),
and after it is created every later pipeline of the process runs on it, with its size (``resolve``). It has no
per-model split (1 + 1 is a pool of one thread).
"""
from __future__ import annotations

import threading

from mirrorsd.errors import DeviceError

_lock = threading.Lock()
_size: int | None = None  # the process's shared pool, once created


def use_shared_pool(options, threads: int) -> None:
    """Make ``options`` (an onnxruntime.SessionOptions) run on the process's shared pool of ``threads`` threads,
    creating the pool on the first call."""
    global _size
    with _lock:
        if _size is None:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(threads, 1)
            _size = threads
        elif _size != threads:
            # Pipeline loads are refused earlier, by resolve(); this guards direct open_graph callers (scripts)
            raise DeviceError(f"The shared thread pool of this process has {_size} threads, not {threads}",
                              "ONNX Runtime sizes its process-wide pool once, and then every session runs on it",
                              f"open every session of this process with {_size} threads, or use another process")
    options.use_per_session_threads = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")


def resolve(requested: bool | None, threads: tuple[int, int], pool_size: int | None) -> bool:
    """Whether a pipeline's ONNX Runtime CPU sessions run on the shared pool: as ``requested`` (None: no), except
    that once the process holds one (``pool_size``, from shared_size()) every session must run on it; then asking
    for pools of their own, or for a split, raises DeviceError (what ONNX Runtime would refuse, said plainly)."""
    if pool_size is None:
        return bool(requested)
    if requested is False or not threads[0] == threads[1] == pool_size:
        raise DeviceError(f"This process runs ONNX Runtime's CPU sessions on a shared pool of {pool_size} threads",
                          "once that pool exists, ONNX Runtime refuses sessions with threads of their own, and the "
                          f"pool has one size (asked: {threads[0]}+{threads[1]} threads, shared pool "
                          f"{'off' if requested is False else 'default'})",
                          f"load this pipeline with {pool_size} threads for both models, or in another process")
    return True


def shared_size() -> int | None:
    """The shared pool's threads, or None when no session of this process uses one."""
    return _size
