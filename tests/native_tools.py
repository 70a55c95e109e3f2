"""libmirrorsd and the programs built with it (the C++ sample, the unit tests, the hostile C driver), built once per
process with CMake: the tests' ``native_build`` fixture and the reliability catalogue's C cases share one build."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
_built: dict[str, SimpleNamespace] = {}


def compiler_missing() -> str:
    """Why libmirrorsd cannot be built here, or ""."""
    if shutil.which("cmake") is None or (shutil.which("c++") or shutil.which("g++")) is None:
        return "no C++ compiler: cmake and a C++17 compiler are needed to build libmirrorsd (runtime/native)"
    return ""


def build(build_dir: Path) -> SimpleNamespace:
    """samples/cpp (which includes runtime/native) built into ``build_dir``, unless this process built it already."""
    if "tools" not in _built:
        from mirrorsd.runtime.native import LIBRARY_NAME, cmake_build

        out = cmake_build(ROOT / "samples" / "cpp", Path(build_dir))
        _built["tools"] = SimpleNamespace(folder=out, library=out / "mirrorsd" / LIBRARY_NAME,
                                          cli=out / "mirrorsd_cli", unit_tests=out / "mirrorsd" / "mirrorsd_unit_tests",
                                          hostile=out / "mirrorsd" / "mirrorsd_hostile")
    return _built["tools"]
