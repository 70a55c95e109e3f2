"""Backends behind one interface: something that opens an ONNX file on a device and runs it.

    backend.open(path, SessionSettings) -> BackendSession
    BackendSession.run(feeds: {name: ndarray}) -> {name: ndarray}
    BackendSession.effective -> what actually runs the graph (provider or compiled device)

ONNX Runtime falls back to CPU silently, so ``effective`` is read back from the session, never assumed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from mirrorsd.errors import GraphFileError


@dataclass(frozen=True)
class SessionSettings:
    """How to run one graph: the device request and the host threads it may use."""

    device: str = "cpu"  # a backend-specific device: "cpu", "cuda", "dml", "NPU", "GPU", "CPU"
    threads: int = 1
    precision: str = "f32"  # OpenVINO inference precision hint; ONNX Runtime CPU is always f32


class BackendSession(Protocol):
    effective: str

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def input_names(self) -> list[str]: ...


class OrtSession:
    """An ONNX Runtime InferenceSession on one execution provider."""

    PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}

    def __init__(self, path: Path, settings: SessionSettings) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, settings.threads)
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # Two sessions share two cores in Mirror-SD: spinning threads would steal the other session's core.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        provider = self.PROVIDERS.get(settings.device, settings.device)
        providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            raise GraphFileError(f"ONNX Runtime could not load '{path.name}'", f"{type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}",
                                 "the file may be truncated or damaged: re-export the folder") from exc
        self.effective = self.session.get_providers()[0]
        self._outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self.session.run(self._outputs, feeds)))

    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]


def default_threads(sessions_running_at_once: int) -> int:
    """Split this machine's cores between the sessions that run concurrently (at least one each)."""
    return max(1, (os.cpu_count() or 1) // max(1, sessions_running_at_once))
