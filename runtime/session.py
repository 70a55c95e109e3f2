"""One wrapper per graph session: owns the backend session, reads names from the manifest, keeps timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mirrorsd.errors import GraphFileError, ManifestError
from mirrorsd.manifest import GraphSpec


@dataclass
class Timeline:
    """Busy intervals of one device (perf_counter seconds), appended by the thread that runs it."""

    intervals: list[tuple[float, float]] = field(default_factory=list)

    def clear(self) -> None:
        self.intervals.clear()


class GraphSession:
    """Runs one graph of an export folder; every tensor name comes from its GraphSpec."""

    def __init__(self, spec: GraphSpec, backend_session, placement, timeline: Timeline) -> None:
        self.spec, self.backend, self.placement, self.timeline = spec, backend_session, placement, timeline
        self.input_names = spec.input_names()
        self.output_names = spec.output_names()
        self.first_input = self.input_names[0]
        # the graph scores rows from a logits_from input on (devices/kernels/logits_rows.py): a prompt chunk feeds
        # its last row's index, every other call 0
        self.logits_from = bool(getattr(backend_session, "logits_rows", False))
        in_place = {name for layer in getattr(backend_session, "kv_in_place", None) or ()
                    for name in (layer.past_key, layer.past_value)}  # fed as views (devices/kernels/kv_in_place.py)
        missing = set(self.input_names) - set(backend_session.input_names()) - in_place
        if missing:
            raise GraphFileError(f"Graph '{spec.file}' lacks inputs the manifest names: {sorted(missing)[:4]}",
                                 "the ONNX file and mirrorsd.json do not belong together", "re-export the folder")

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        outputs = self.backend.run(feeds)
        self.timeline.intervals.append((start, time.perf_counter()))
        return outputs


def graph_path(folder: Path, spec: GraphSpec) -> Path:
    """The checked path of a graph: inside ``folder``, present, and reading no tensor from outside its folder."""
    from mirrorsd.manifest import check_inside
    from mirrorsd.runtime.graph_files import check_external_data

    path = check_inside(folder, spec.file, f"graph '{spec.role}'")
    if not path.is_file():
        raise GraphFileError(f"Graph file '{spec.file}' is missing from {folder}", "the folder is incomplete",
                             "re-export the folder")
    check_external_data(path)  # before any backend opens it: they follow external-data paths as written
    return path


def check_source_folder(source: Path, manifest, command: str) -> None:
    """What loading the folder checks, before anything is copied: every graph (and its external data) inside the
    folder, and no symbolic link anywhere in it that leads out of it (a copy would follow it)."""
    for spec in manifest.graphs.values():
        graph_path(source, spec)
    for item in source.rglob("*"):
        if item.is_symlink() and not item.resolve().is_relative_to(source):
            raise ManifestError(f"'{item}' is a symbolic link to '{item.resolve()}', outside the export folder",
                                f"{command} copies the folder, and a copy would follow the link",
                                "do not use this folder; re-export the model yourself")
