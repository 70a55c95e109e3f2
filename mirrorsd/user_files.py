"""Reading a file that a user named or a cache holds, without trusting it: a regular file, below a size cap, text.

    read_text(path, limit, fail)    the file's text; ``fail(why)`` builds the error when it is not a regular file
                                    (a folder, a FIFO, a device such as /dev/zero), is larger than ``limit``, cannot
                                    be read or is not UTF-8. Opened without blocking, so a FIFO never hangs.
    read_json(path, limit, fail)    the same, parsed as JSON; nesting too deep to parse is ``fail`` too, not a
                                    RecursionError

Every JSON or JSONL file mirrorsd reads from a path it was given goes through here (profiles, exit sweeps,
question files, manifests, the train-draft answer cache): a file a thousand times larger than any real one, or an
endless one behind a symbolic link, fails at once instead of filling memory.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable

from mirrorsd.errors import MirrorSDError

KIB, MIB = 2**10, 2**20
JSON_LIMIT = 64 * MIB  # a profile, a manifest, an exit sweep: kilobytes (a manifest with a large template: < 1 MiB)
QUESTIONS_LIMIT = 256 * MIB  # SpecBench's question.jsonl is about 1 MiB


def read_text(path: str | os.PathLike, limit: int, fail: Callable[[str], MirrorSDError]) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; ``fail(why)`` otherwise (raised)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise fail(f"it is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise fail(f"it holds {info.st_size:,} bytes, more than the {limit:,} such a file can plausibly need")
        chunks, size = [], 0
        while size <= limit:  # the size can change under us: never read past the limit
            chunk = os.read(fd, min(MIB, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise fail(f"it grew past {limit:,} bytes while being read")
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"it is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike, limit: int, fail: Callable[[str], MirrorSDError]):
    """The JSON value of ``path`` (read by ``read_text``); invalid or too deeply nested JSON is ``fail`` too."""
    text = read_text(path, limit, fail)
    return parse_json(text, fail)


def parse_json(text: str, fail: Callable[[str], MirrorSDError]):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"it is not valid JSON ({exc})") from None
    except RecursionError:
        raise fail("its JSON is nested too deeply to read") from None


def _kind(mode: int) -> str:
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a plain file"



def resolved(path: str | os.PathLike, flag: str, error: type[MirrorSDError]) -> Path:
    """``path`` made absolute with every symbolic link followed; ``error`` (naming ``flag``) when a link loops or
    the path cannot be followed (Path.resolve raises RuntimeError or OSError then, by Python version)."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as exc:
        raise error(f"{flag} '{path}' cannot be followed", f"it leads into a loop of symbolic links ({exc})"
                    if "loop" in str(exc).lower() or getattr(exc, "errno", None) == 40 else str(exc),
                    f"pass the real path of the folder to {flag}") from None
