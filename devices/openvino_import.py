"""Importing the OpenVINO runtime without its usage telemetry.

    load_openvino() -> the ``openvino`` module        (raises ImportError as ``import openvino`` does)

``import openvino`` also imports its model converter (``openvino.tools.ovc``), and that sends a usage event unless
the user opted out: from a background thread it forks the process (``multiprocessing``, fork start method) to post
the event, waits up to 3 s, and writes a client id under ``~/intel``. In an inference process that is more than a
privacy question: a fork taken while ONNX Runtime's pool threads run can leave the child blocked on a lock another
thread held (the dynamic loader's), and ``multiprocessing`` joins its children at interpreter exit, so the command
never ends. It also costs ~0.08 s of every start (a process importing OpenVINO: 0.31 -> 0.23 s without it).

OpenVINO runs without the ``openvino_telemetry`` package, with a no-op stand-in of its own. ``load_openvino`` makes
that package unimportable for the length of the first import, so the converter binds the stand-in, and then
restores ``sys.modules`` as it was: nothing else in the process changes, and a later explicit import of the
converter's tools behaves as OpenVINO ships them. A host that imported OpenVINO before mirrorsd keeps what it
chose.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from types import ModuleType

TELEMETRY_MODULE = "openvino_telemetry"  # pip: openvino-telemetry, installed with openvino
_first_import = threading.Lock()  # two threads' first imports must not save and restore each other's marker


def load_openvino() -> ModuleType:
    """The ``openvino`` module, imported (once a process) with its usage telemetry replaced by OpenVINO's no-op."""
    with _first_import:
        loaded = sys.modules.get("openvino")
        if loaded is not None:
            return loaded
        with _unimportable(TELEMETRY_MODULE):
            return importlib.import_module("openvino")


@contextlib.contextmanager
def _unimportable(name: str):
    """``import name`` raises ImportError inside the block; ``sys.modules`` is restored after it, on error too."""
    missing = object()
    saved = sys.modules.get(name, missing)
    sys.modules[name] = None  # the import system's own marker for "this module cannot be imported"
    try:
        yield
    finally:
        if saved is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved
