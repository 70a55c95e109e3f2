"""Python child processes for tests, started without ``preexec_fn``.

``preexec_fn`` runs Python in the forked child before ``exec``; the test process has other threads (ONNX Runtime's
pools, reader threads), and a fork copies whatever lock one of them held (the dynamic loader's, an allocator's), so
such a child can block forever. Instead the child is a second Python that sets what the test asks for (the default
SIGINT disposition, an address-space limit) and then replaces itself with the real command: both survive ``exec``.
"""
from __future__ import annotations

import sys

_PRELUDE = """
import os, resource, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def python_command(*args: str, memory_limit: int = 0) -> list[str]:
    """``[python, *args]`` run with SIGINT at its default (a test run started with ``cmd &`` inherits it ignored, and
    Python then installs no KeyboardInterrupt handler) and, if ``memory_limit`` > 0, that many bytes of address space."""
    return [sys.executable, "-c", _PRELUDE, str(memory_limit), *args]
