"""``mirrorsd unpack``: a copy of an export folder whose packed weights (mirrorsd-export --weight-storage packed,
export/packed_weights.py) are written out plain, for hosts that load the graph files themselves.

mirrorsd's runtime unpacks a packed folder when it opens it (devices/unpack.py), so it never needs this. A C, C++ or
C# host that gives the files to ONNX Runtime gets them unpacked by ONNX Runtime's constant folding, which holds every
temporary tensor until the graph is folded (the Qwen2.5-Coder 1.5B suffix with a widened Q6_K head: about 13 GB and
30 s at load): unpacking once here gives that host the plain folder instead (the same numbers bit for bit, the size
of a plain export). No torch or onnx needed. Written atomically like an export (mirrorsd/output_folder.py).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

from mirrorsd.errors import ExportOptionError
from mirrorsd.manifest import load_manifest
from mirrorsd.output_folder import EXPORT, StagedFolder, check_output, copy_file
from mirrorsd.runtime.session import check_source_folder


def unpack_folder(source: Path, output: Path, force: bool = False,
                  progress: Callable[[str], None] = lambda step: None) -> Path:
    """Write ``source`` to ``output`` with every graph's packed weights unpacked; returns the output folder."""
    from mirrorsd.devices.unpack import unpacked_bytes

    source = Path(source).expanduser().resolve()
    manifest = load_manifest(source)
    options = manifest.export_options
    if "packed" not in (options.get("weight_storage"), options.get("draft_weight_storage")):
        raise ExportOptionError(f"'{source}' has no packed weights", "its export_options say weight_storage "
                                f"{options.get('weight_storage', 'plain')!r}: its graphs are plain already",
                                "load it as it is")
    output = check_output(output, [source], force, EXPORT)
    check_source_folder(source, manifest, "unpack")
    with StagedFolder(output) as stage:
        graphs = {spec.file for spec in manifest.graphs.values()}
        for item in sorted(source.iterdir()):
            dest = stage.path / item.name
            if item.name in graphs:
                progress(f"unpacking {item.name}")
                data = unpacked_bytes(item)
                if data is not None:
                    dest.write_bytes(data)
                    continue
            shutil.copytree(item, dest) if item.is_dir() else copy_file(item, dest)
        unpacked = {**options, "weight_storage": "plain", "draft_weight_storage": None,
                    "unpacked_from": str(source)}
        dataclasses.replace(manifest, export_options=unpacked).save(stage.path)
        stage.publish()
    return output
