"""Build libmirrorsd_kern from the sources beside this file, once per (sources, ONNX Runtime, compiler), on demand.

    <cache>/kernels/<hash>/libmirrorsd_kern.so      <cache> = $MIRRORSD_CACHE or ~/.cache/mirrorsd
    <hash> = sha256 of every source and header, the ONNX Runtime version, the compiler's version line, the machine

The compiler line is the one devices/kernels/CMakeLists.txt describes (each SIMD path's file with its own -m flags,
cpuid choosing at run time); a plain compiler call keeps the build to what a machine with g++ or clang++ has. The
library links nothing but libstdc++: ONNX Runtime hands it its API table at registration. Builds happen in a
private folder and are renamed into place, under a lock, so concurrent processes never see half a library.

A cached library is checked before it is loaded (cache.py: a regular file whose bytes match the checksum written at
build time). A damaged entry is moved aside and rebuilt once; when the rebuild fails too, KernelsUnavailableError
says why (``--kernels auto`` then runs ONNX Runtime's kernels). Either way one KernelCacheWarning line says so.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import KernelsUnavailableError
from mirrorsd.devices.kernels import cache as entries
from mirrorsd.weights import default_cache_dir

HERE = Path(__file__).parent
SOURCES = HERE / "src"
# ONNX Runtime's C API headers, vendored once beside libmirrorsd (runtime/native); the same relative path in the
# repository and in an installed copy (mirrorsd/devices/kernels, mirrorsd/runtime/native)
ORT_HEADERS = HERE.parent.parent / "runtime" / "native" / "third_party" / "onnxruntime" / "include"
LIBRARY_NAME = "libmirrorsd_kern.so"
# -O3 unrolls the kernels' fixed-count loops (accumulators in registers); see CMakeLists.txt for every flag
BASE_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
              "-fvisibility-inlines-hidden", "-Wall", "-Wextra", "-Wno-maybe-uninitialized")
# file -> its instruction-set flags; files not named here are built for the baseline CPU
X86_FILES = {"gemm_avx2.cpp": ("-mavx2", "-mfma"),
             "gemm_avx512.cpp": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"),
             "gemm_amx.cpp": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mamx-tile",
                              "-mamx-int8")}
# the layout of a cache entry (2: with its checksum); entries of another layout are never read
ENTRY_FORMAT = "2"
FAST_PATHS = ("avx512vnni", "amx", "avx2")  # the paths worth using instead of ONNX Runtime's kernel, in the order
# the library picks them (amx only when forced: see src/register.cpp)


@dataclass(frozen=True)
class KernelLibrary:
    """A built library and what this CPU runs of it."""

    path: Path
    paths: dict[str, bool]  # every path the build has -> this CPU runs it ("avx512vnni", "avx2", "scalar")

    @property
    def fast_path(self) -> str | None:
        """The path ONNX Runtime sessions will use (None: only the slow scalar reference runs here)."""
        return next((name for name in FAST_PATHS if self.paths.get(name)), None)


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def source_files() -> list[Path]:
    """The .cpp files this machine compiles (the SIMD paths only on x86-64)."""
    return sorted(p for p in SOURCES.glob("*.cpp") if is_x86() or p.name not in X86_FILES)


def find_compiler() -> str | None:
    """$CXX if set, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((found for name in ("c++", "g++", "clang++") if (found := shutil.which(name))), None)


@functools.lru_cache(maxsize=None)
def build_hash(compiler: str) -> str:
    """The build's name: sources, headers, compiler version, ONNX Runtime version, machine and flags (once per
    process and compiler: it reads every source and runs the compiler, and profile lookups ask per file)."""
    import onnxruntime

    digest = hashlib.sha256()
    for path in sorted([*SOURCES.iterdir(), *ORT_HEADERS.iterdir()]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    for text in (onnxruntime.__version__, version, platform.machine(), " ".join(BASE_FLAGS), ENTRY_FORMAT):
        digest.update(text.encode() + b"\0")
    return digest.hexdigest()[:16]


class KernelCacheWarning(UserWarning):
    """The cached kernel library was damaged: it was rebuilt, or ONNX Runtime's kernels run instead (one line)."""


# folder -> the library found or built there, or why none can be: settled once per process, so a failed rebuild is
# not retried by every session that asks
_RESOLVED: dict[Path, KernelLibrary | KernelsUnavailableError] = {}


def library(cache: Path | None = None) -> KernelLibrary:
    """The built library (building it on first use, rebuilding a damaged one once); raises KernelsUnavailableError
    when it cannot be built or loaded."""
    if not sys.platform.startswith("linux"):
        raise KernelsUnavailableError(f"mirrorsd kernels are not built on {sys.platform}",
                                      "the on-demand build knows the Linux toolchain only",
                                      "build devices/kernels with CMake, or run with ONNX Runtime's kernels")
    compiler = find_compiler()
    if compiler is None:
        raise KernelsUnavailableError("No C++ compiler found to build the mirrorsd kernels",
                                      "none of $CXX, c++, g++, clang++ is on PATH",
                                      "install one (e.g. apt-get install g++), or run with ONNX Runtime's kernels")
    folder = (cache or default_cache_dir()) / "kernels" / build_hash(compiler)
    if folder not in _RESOLVED:
        try:
            _RESOLVED[folder] = _load_or_build(compiler, folder)
        except KernelsUnavailableError as exc:
            _RESOLVED[folder] = exc
    found = _RESOLVED[folder]
    if isinstance(found, KernelsUnavailableError):
        raise found
    return found


def _load_or_build(compiler: str, folder: Path) -> KernelLibrary:
    """Load the cached library when it is sound; else build it, moving a damaged entry aside first (once)."""
    problem = entries.entry_problem(folder, LIBRARY_NAME)
    if problem is None:
        try:
            return _loaded(folder)
        except KernelsUnavailableError as exc:
            problem = f"it does not load: {exc.why}"
    damage = None if problem == "missing" else problem
    try:
        _build_locked(compiler, folder, damage, entries.identity(folder))
        if (after := entries.entry_problem(folder, LIBRARY_NAME)) is not None:
            raise KernelsUnavailableError("The built mirrorsd kernel library is not sound", after,
                                          f"remove {folder} and run python -m mirrorsd.devices.kernels")
        built = _loaded(folder)
    except KernelsUnavailableError as exc:
        if damage is not None:
            warnings.warn(f"mirrorsd kernels: the cached library in {folder} was damaged ({damage}) and rebuilding "
                          f"it failed ({exc.what.rstrip('.')}): ONNX Runtime's kernels run instead",
                          KernelCacheWarning, stacklevel=4)
        raise
    if damage is not None:
        warnings.warn(f"mirrorsd kernels: the cached library in {folder} was damaged ({damage}); rebuilt it",
                      KernelCacheWarning, stacklevel=4)
    return built


def _loaded(folder: Path) -> KernelLibrary:
    path = folder / LIBRARY_NAME
    return KernelLibrary(path, probe_paths(path))


def probe_paths(path: Path) -> dict[str, bool]:
    """Ask the library which of its paths this CPU runs (the same cpuid test it applies when a session loads)."""
    try:
        handle = ctypes.CDLL(str(path))
        handle.RegisterCustomOps  # noqa: B018 - the entry point ONNX Runtime will look up
        handle.mirrorsd_kern_paths.restype = ctypes.c_char_p
        pairs = handle.mirrorsd_kern_paths().decode().split(",")
        return {name: flag == "1" for name, flag in (pair.split(":") for pair in pairs)}
    except (OSError, AttributeError, ValueError, UnicodeDecodeError) as exc:
        raise KernelsUnavailableError(f"The mirrorsd kernel library {path} does not load", str(exc)[:300],
                                      "remove it and run python -m mirrorsd.devices.kernels, or run with ONNX "
                                      "Runtime's kernels") from None


def _build_locked(compiler: str, folder: Path, damage: str | None, seen: tuple | None = None) -> None:
    """Build the library into ``folder`` under a lock, first moving aside a damaged entry (``damage`` says what is
    wrong, or None; ``seen`` is the entry's identity when it was found damaged) or a file where the kernels folder
    belongs. A cache it cannot write raises KernelsUnavailableError."""
    import fcntl

    try:
        if folder.parent.exists() and not folder.parent.is_dir():
            entries.move_aside(folder.parent)
        folder.parent.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f".{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building (or repairing) the same library
            problem = entries.entry_problem(folder, LIBRARY_NAME)
            if problem is None and (damage is None or entries.identity(folder) != seen):
                return  # another process built (or repaired) it meanwhile
            if problem != "missing":
                entries.move_aside(folder)  # nothing is deleted: the damaged entry keeps its bytes, renamed
            work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
            try:
                compile_library(compiler, work / LIBRARY_NAME)
                entries.write_stamp(work / LIBRARY_NAME)
                os.replace(work, folder)  # atomic: the folder appears with its library and checksum in it
            finally:
                shutil.rmtree(work, ignore_errors=True)  # gone after the rename; a failed build's leftovers
    except OSError as exc:
        raise KernelsUnavailableError(f"Cannot build the mirrorsd kernels in {folder.parent}",
                                      f"{exc.strerror or exc} ({exc.filename or folder})",
                                      "make the cache folder writable (or set MIRRORSD_CACHE to one that is), or "
                                      "run with ONNX Runtime's kernels") from None


def compile_library(compiler: str, output: Path) -> None:
    """Compile every source (in parallel) and link ``output``; raises KernelsUnavailableError with the first error."""
    objects, jobs = [], []
    for source in source_files():
        obj = output.parent / (source.stem + ".o")
        command = [compiler, *BASE_FLAGS, *X86_FILES.get(source.name, ()), f"-I{SOURCES}", f"-I{ORT_HEADERS}",
                   "-c", str(source), "-o", str(obj)]
        jobs.append((source, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        objects.append(str(obj))
    outputs = [(source, job.communicate()[0], job.returncode) for source, job in jobs]
    failed = [(source, out) for source, out, code in outputs if code]
    if failed:
        _raise_compile_error(f"compiling {failed[0][0].name}", failed[0][1])
    link = subprocess.run([compiler, "-shared", "-o", str(output), *objects, "-pthread"], capture_output=True)
    if link.returncode:
        _raise_compile_error("linking", link.stdout + link.stderr)


def _raise_compile_error(step: str, output: bytes) -> None:
    tail = output.decode(errors="replace").strip().splitlines()[-6:]
    raise KernelsUnavailableError(f"Building the mirrorsd kernels failed while {step}", " | ".join(tail)[:800],
                                  "check the compiler (C++17 with x86 intrinsics: g++ >= 9 or clang++ >= 10), or "
                                  "run with ONNX Runtime's kernels")
