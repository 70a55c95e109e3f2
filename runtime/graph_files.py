"""Refuse an ONNX graph whose tensors live outside its export folder, before any backend opens it.

An ONNX file may keep tensors in external files named by a ``location`` string; ONNX Runtime and OpenVINO read
whatever it names. A folder someone sent you could point one at ``../../.ssh/id_rsa`` or ``/etc/shadow`` (read into
a weight, and from there into logits), so every location must stay beside its graph, like the manifest's file names.

Why a scan of the protobuf wire format instead of ``onnx.load(path, load_external_data=False)``: onnx is an
export-time dependency (the runtime installs without it, STYLE.md 14), and ``onnx.load`` turns every inline weight
into Python objects (seconds and a second copy in memory for a large graph). The scan maps the file and only walks
the messages that can hold tensors, skipping weight bytes by their length (the walker and the field numbers it
follows are in mirrorsd/onnx_wire.py).

tests/test_reliability_load.py checks the scan against onnx's own parser.
"""
from __future__ import annotations

import mmap
from pathlib import Path

from mirrorsd.errors import GraphFileError, ManifestError
from mirrorsd.manifest import check_inside
from mirrorsd.onnx_wire import LENGTH_DELIMITED, MalformedProtobuf, fields, messages, read_text


def check_external_data(path: Path) -> None:
    """Raise GraphFileError if ``path`` is not a readable protobuf or names external data outside its folder."""
    for tensor, location in external_locations(path):
        try:
            check_inside(path.parent, location, f"tensor '{tensor}'")
        except ManifestError as exc:
            raise GraphFileError(
                f"Graph '{path.name}' reads tensor '{tensor}' from outside its folder: {location!r}", exc.why,
                "do not use this folder; re-export the model yourself") from None


def external_locations(path: Path) -> list[tuple[str, str]]:
    """(tensor name, external data location) of every tensor in the ONNX file at ``path``, subgraphs included."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _scan(mapped)  # indexing an mmap copies nothing; slicing copies only that slice
    except (MalformedProtobuf, ValueError) as exc:  # mmap raises ValueError for an empty file
        raise GraphFileError(f"Graph file '{path.name}' is not a valid ONNX file", f"{exc} (truncated or damaged)",
                             "re-export the folder") from None


def _scan(buf: mmap.mmap) -> list[tuple[str, str]]:
    found = []
    for start, end in messages(buf, "tensor"):
        found += _tensor_locations(buf, start, end)
    return found


def _tensor_locations(buf: mmap.mmap, start: int, end: int) -> list[tuple[str, str]]:
    name, locations = "", []
    for field, wire, lo, hi in fields(buf, start, end):
        if wire != LENGTH_DELIMITED:
            continue
        if field == 8:
            name = read_text(buf, lo, hi)
        elif field == 13:
            entry = {f: read_text(buf, a, b) for f, w, a, b in fields(buf, lo, hi) if w == LENGTH_DELIMITED}
            if entry.get(1) == "location":
                locations.append(entry.get(2, ""))
    return [(name, loc) for loc in locations]
