"""One ONNX Runtime thread pool shared by every CPU session of the process (opt-in: ``DeviceRequest.shared_pool``,
``--shared-pool``).

By default each ONNX Runtime session owns a pool of its own threads, which sleep when idle (spinning off, because
Mirror-SD runs the draft's and the target's sessions at once on the same cores). A pipeline holds four to six
CPU sessions (prefix, exit head, suffix, draft, ...) and ar and sd run them one after another, so each parallel
section of each graph starts by waking sleeping threads. With one pool for all of them whose threads spin between
calls, they do not sleep between the graphs of a step: on the int4 Qwen pair (2 cores, 48-token answers, three
alternated rounds) ar measured 18.14 -> 20.68 tok/s (+14 %, every round) and sd 15.88 -> 16.87 (docs/performance.md).
Spinning threads of *separate* pools compete instead: per-session pools with spinning on were 1.9x slower.

The pool is the process's: ONNX Runtime takes its size once, so every shared-pool pipeline of a process uses the same
thread count (another count raises DeviceError), and there is no per-session thread split (1 + 1): mode auto does
not plan threads with it.
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
            raise DeviceError(f"The shared thread pool of this process has {_size} threads, not {threads}",
                              "ONNX Runtime sizes its process-wide pool once",
                              f"use --threads {_size} for every shared-pool pipeline of this process, or leave "
                              f"--shared-pool off")
    options.use_per_session_threads = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")


def shared_size() -> int | None:
    """The shared pool's threads, or None when no session of this process uses one."""
    return _size
