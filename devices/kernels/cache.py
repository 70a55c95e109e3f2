"""The kernel library's cache entry, never trusted blindly: what is wrong with one, its checksum, and moving a damaged
one aside.

    <cache>/kernels/<hash>/libmirrorsd_kern.so          the library
    <cache>/kernels/<hash>/libmirrorsd_kern.so.sha256   its sha256, written by the build before the entry appears

A library is loaded into the process (ctypes, then ONNX Runtime) only when it is a regular file of plausible size
whose bytes match the checksum written when it was built: an empty, truncated or garbage file, a folder where a file
belongs (or the reverse), a FIFO or an endless file are found without loading them. A damaged entry is renamed
aside (``.<hash>.damaged-*``, nothing deleted) so that the build can make a fresh one in its place.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

STAMP_SUFFIX = ".sha256"
MAX_LIBRARY_BYTES = 64 << 20  # the library is well under a megabyte; a larger file is not one of ours
MAX_STAMP_BYTES = 256


def stamp_path(library: Path) -> Path:
    return library.with_name(library.name + STAMP_SUFFIX)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_stamp(library: Path) -> None:
    """Record the library's checksum beside it (in the private build folder, before it is published)."""
    stamp_path(library).write_text(digest(library) + "\n")


def _regular_file_problem(path: Path, limit: int) -> str | None:
    """Why ``path`` (followed if a link) is not a readable regular file of at most ``limit`` bytes, or None."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:  # a link loop, a permission problem
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISDIR(info.st_mode):
        return "a folder, not a file"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size == 0:
        return "empty"
    if info.st_size > limit:
        return f"implausibly large ({info.st_size} bytes)"
    return None


def entry_problem(folder: Path, library_name: str) -> str | None:
    """None when ``folder`` holds a library whose bytes match its checksum; "missing" when there is no entry at all;
    else what is wrong with it, in a few words."""
    if folder.parent.exists() and not folder.parent.is_dir():
        return "a file where the kernels folder belongs"
    if not folder.exists() and not folder.is_symlink():
        return "missing"
    if not folder.is_dir():
        return "a file where its folder belongs"
    library = folder / library_name
    if (problem := _regular_file_problem(library, MAX_LIBRARY_BYTES)) is not None:
        return "no library in it" if problem == "missing" else f"the library is {problem}"
    stamp = stamp_path(library)
    if (problem := _regular_file_problem(stamp, MAX_STAMP_BYTES)) is not None:
        return "no checksum beside the library" if problem == "missing" else f"its checksum file is {problem}"
    try:
        recorded = stamp.read_text(errors="replace").strip()
        actual = digest(library)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if recorded == actual else "the library's bytes do not match its checksum"


def identity(path: Path) -> tuple | None:
    """Which entry ``path`` is now (device, inode, change time), or None when there is none: a process that found an
    entry damaged rebuilds it only if it is still the same entry once the build lock is held."""
    try:
        info = path.lstat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


def move_aside(path: Path) -> Path:
    """Rename a damaged entry (file or folder) to ``.<name>.damaged-*`` beside it; returns the new name."""
    holder = Path(tempfile.mkdtemp(prefix=f".{path.name}.damaged-", dir=path.parent))
    moved = holder / path.name
    os.replace(path, moved)
    return holder
