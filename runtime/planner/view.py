"""What the planner reads of a loaded pipeline: a narrow, typed view instead of the whole Pipeline.

Profiling (profiling.py) times the pipeline's own models on their placement and runs short Mirror-SD generations to
calibrate the acceptance; it reads nothing else. Pipeline.planner_view builds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mirrorsd.manifest import Manifest


@dataclass(frozen=True)
class PipelineView:
    folder: Path  # the export folder (the profile cache keys on it)
    manifest: Manifest
    target: Any  # models.TargetModel: prefix, exit head(s), suffix on one KV cache
    draft: Any  # models.DraftModel or static_cache.StaticDraftModel
    streaming_draft: Any  # the streaming draft, or None
    target_timeline: Any  # session.Timeline of the target's graphs (and of the draft's, below)
    draft_timeline: Any
    placement: dict[str, str]  # graph role -> where it runs (devices.placement.Placement.describe())
    devices: dict[str, str]  # model -> the device string that reopens it there ("cpu", "openvino:CPU", ...)
    threads: tuple[int, int]  # intra-op threads of the target's and the draft's sessions
    shared_pool: bool  # whether its ONNX Runtime CPU sessions run on the process's shared pool
    encode: Callable  # (prompt text, GenerationConfig) -> token ids
    generate: Callable  # (prompt text, GenerationConfig) -> GenerationResult: the calibration's Mirror-SD runs

    @property
    def thread_key(self) -> tuple[int, int, bool]:
        """(target threads, draft threads, shared pool): the split of a profile this view measures."""
        return (*self.threads, self.shared_pool)
