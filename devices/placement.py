"""Placement: which backend and device runs each graph, decided once per pipeline and reported as it really is.

This first version knows ONNX Runtime's CPU execution provider only; the devices issue extends it with probing,
CUDA/DirectML/OpenVINO chains and the OpenVINO runtime backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mirrorsd.devices.backends import OrtSession, SessionSettings
from mirrorsd.errors import DeviceError

AUTO = "auto"


@dataclass(frozen=True)
class DeviceRequest:
    """What the user asked for: a device per model ("auto" = the default chain) and threads per session."""

    target: str = AUTO
    draft: str = AUTO
    target_threads: int | None = None
    draft_threads: int | None = None


@dataclass(frozen=True)
class Placement:
    model: str  # "target" or "draft"
    requested: str
    effective: str  # what runs the graph, read back from the backend
    backend: str
    fell_back: bool
    reason: str = ""

    def describe(self) -> str:
        note = f" (fell back: {self.reason})" if self.fell_back else ""
        return f"{self.backend}:{self.effective}{note}"


KNOWN = {"auto", "cpu", "ort-cpu"}


def open_graph(path: Path, model: str, request: DeviceRequest, threads: int):
    """Open one graph for ``model`` as the request says; returns (backend session, Placement)."""
    asked = request.target if model == "target" else request.draft
    if asked not in KNOWN:
        raise DeviceError(f"Device '{asked}' for the {model} is not available", "this build knows only the CPU",
                          f"use one of: {', '.join(sorted(KNOWN))}")
    session = OrtSession(path, SessionSettings("cpu", threads))
    return session, Placement(model, asked, session.effective, "onnxruntime", False)
