"""Damaged kernel-library caches for the tests (tests/test_kernels_cache.py and the reliability catalogue): a cache
entry broken in each way a user or a crash can break it, and a stand-in compiler so that a rebuild takes a second.

The stand-in compiler copies a library the real compiler built (it is the cache's handling under test here, not the
compiler; tests/test_kernels_build.py builds with the real one). Its ``--version`` line differs from the real
compiler's, so its entries live under a hash of their own and never touch the real cache.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

LIBRARY = "libmirrorsd_kern.so"


def copying_compiler(folder: Path, built: Path, works: bool = True) -> Path:
    """A compiler stand-in: object files come out empty, the link step copies ``built``; each call is logged (one
    line, its arguments) to ``folder/compiler.log``. ``works=False``: every compile fails with an error message."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "compiler.log"
    script = folder / ("copying-c++" if works else "failing-c++")
    body = (f'out=""; prev=""; shared=0\n'
            f'for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; [ "$a" = "-shared" ] && shared=1; prev="$a"; done\n'
            f'if [ $shared = 1 ]; then cp "{built}" "$out"; else : > "$out"; fi\n') if works else \
        'echo "error: the stand-in compiler refuses" >&2\nexit 1\n'
    version = f'if [ "$1" = "--version" ]; then echo "stand-in c++ 1.0 ({script.name})"; exit 0; fi\n'
    script.write_text(f'#!/bin/sh\n{version}echo "$*" >> "{log}"\n{body}')
    script.chmod(0o755)
    return script


def links(compiler: Path) -> int:
    """How many libraries the stand-in compiler linked (or tried to compile, when it fails)."""
    log = compiler.parent / "compiler.log"
    if not log.exists():
        return 0
    lines = log.read_text().splitlines()
    return sum("-shared" in line for line in lines) or sum(" -c " in f" {line} " for line in lines)


def entry(cache: Path, compiler: Path) -> Path:
    """The folder the library built by ``compiler`` lives in, under ``cache``."""
    from mirrorsd.devices.kernels.build import build_hash

    return cache / "kernels" / build_hash(str(compiler))


def damage(cache: Path, compiler: Path, how: str, built: Path) -> Path:
    """Make the cache entry of ``compiler`` under ``cache`` damaged in the way ``how`` names; returns the entry."""
    folder = entry(cache, compiler)
    if how == "kernels-folder-is-a-file":
        folder.parent.parent.mkdir(parents=True, exist_ok=True)
        folder.parent.write_text("not a folder\n")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    if how == "entry-is-a-file":
        folder.write_bytes(b"\x7fELF garbage")
        return folder
    folder.mkdir()
    library = folder / LIBRARY
    good = built.read_bytes()
    if how == "empty":
        library.write_bytes(b"")
    elif how == "garbage":
        library.write_bytes(os.urandom(4096))
    elif how == "truncated":
        library.write_bytes(good[: len(good) // 3])
    elif how == "library-is-a-folder":
        (library / "inside").mkdir(parents=True)
    elif how == "fifo":
        os.mkfifo(library)
    elif how == "flipped-byte":  # what a bad disk does: the checksum no longer matches
        changed = bytearray(good)
        changed[len(changed) // 2] ^= 0x01
        library.write_bytes(bytes(changed))
    elif how == "no-checksum":
        shutil.copy(built, library)
        return folder
    else:
        raise ValueError(how)
    stamp = built.with_name(LIBRARY + ".sha256")  # the good library's checksum, beside the damaged one
    if stamp.exists():
        shutil.copy(stamp, folder / stamp.name)
    return folder


HOW = ("empty", "garbage", "truncated", "flipped-byte", "no-checksum", "library-is-a-folder", "fifo",
       "entry-is-a-file", "kernels-folder-is-a-file")
