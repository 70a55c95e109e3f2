"""Where a command may write, and how: one set of rules for export, quantize, train-draft and bench.

    check_output(output, sources, force, kind)   refuse a folder the command must not fill or replace
    staged(output)                                a scratch folder beside it, published by rename on success and
                                                  removed on any error, Ctrl-C and SIGTERM included
    StagedFolder(output, resumable)               the same as an object; resumable keeps .NAME.partial when a run
                                                  stops (mirrorsd-export --resume) and continues it next time

Refused, with or without --force: an empty path, the working directory or a folder above it, a source (the model,
the draft, the export being quantized), a folder that contains a source, a folder inside a source, and a file.
A folder that exists and is not empty is replaced only with --force, and only when it holds what this command
writes (``kind.marker``: an export's manifest, a bench report, a streaming draft): everything else in the user's
folders is theirs, and nothing the tool did not make is ever deleted.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.cli_exit import raise_if_terminated
from mirrorsd.errors import OutputFolderError
from mirrorsd.user_files import resolved


@dataclass(frozen=True)
class OutputKind:
    """What a command writes: its name for messages, and the files that mark a folder it wrote."""

    name: str  # "export", "bench report", "streaming draft"
    markers: tuple[str, ...]  # any one of them marks a folder this command wrote (replaceable with --force)
    example: str  # a fresh folder to suggest, e.g. "exports/NAME"
    replace: str = "pass --force to replace it (only after this run succeeds)"


EXPORT = OutputKind("mirrorsd export", ("mirrorsd.json",), "exports/NAME")
BENCH = OutputKind("mirrorsd bench report", ("runs.json",), "bench_out/NAME")
STREAMING_DRAFT = OutputKind("mirrorsd-train-draft folder", ("streaming.json", "train_state", "distill.json"),
                             "drafts/NAME", "pass --resume to continue it, or --force to start over (the cached "
                                            "target answers are kept)")


def check_output(output: str | os.PathLike, sources: Sequence[str | os.PathLike], force: bool, kind: OutputKind,
                 flag: str = "--output") -> Path:
    """The resolved output folder, or OutputFolderError saying why it may not be written (see the module doc)."""
    try:
        return _check_output(output, sources, force, kind, flag)
    except OSError as exc:  # a name too long, a path through a file, a folder we may not list
        raise OutputFolderError(f"{flag} '{output}' cannot be used", exc.strerror or str(exc),
                                remedy(exc).replace("--output", flag)) from None


def _check_output(output, sources, force: bool, kind: OutputKind, flag: str) -> Path:
    if not str(output).strip():
        raise OutputFolderError(f"{flag} is empty", "an empty path means the working directory",
                                f"name a new folder, e.g. {flag} {kind.example}")
    path = resolved(output, flag, OutputFolderError)
    here = Path.cwd().resolve()
    if path == here or here.is_relative_to(path):
        raise OutputFolderError(f"{flag} '{output}' is the working directory or a folder above it",
                                f"it holds your files, and a {kind.name} is written as a folder of its own",
                                f"name a new folder, e.g. {flag} {kind.example}")
    for source in sources:
        _refuse_overlap(path, resolved(source, "a source", OutputFolderError), output, kind, flag)
    if path.exists() and not path.is_dir():
        raise OutputFolderError(f"{flag} '{output}' is a file", f"a {kind.name} is a folder",
                                f"pick another {flag}")
    if path.is_dir() and any(path.iterdir()):
        if not is_made_by(path, kind):
            raise OutputFolderError(f"{flag} '{output}' is a folder that is not empty and not a {kind.name}",
                                    "only a folder this command wrote may be replaced, even with --force",
                                    f"pick a new or empty folder, e.g. {flag} {kind.example}")
        if not force:
            raise OutputFolderError(f"{flag} '{output}' holds a previous {kind.name}",
                                    "nothing is overwritten without asking",
                                    f"{kind.replace}, or pick another {flag}")
    return path


def is_made_by(folder: Path, kind: OutputKind) -> bool:
    return any((folder / marker).exists() for marker in kind.markers)


def _refuse_overlap(path: Path, source: Path, given, kind: OutputKind, flag: str) -> None:
    if path == source:
        why = "it is where the command reads from"
    elif source.is_relative_to(path):
        why = f"it contains '{source}', which the command reads"
    elif path.is_relative_to(source) and source.is_dir():
        why = f"it is inside '{source}', which the command reads"
    else:
        return
    raise OutputFolderError(f"{flag} '{given}' overlaps a source", why,
                            f"write the {kind.name} to a folder of its own, e.g. {flag} {kind.example}")


try:  # POSIX only; on Windows two resumable runs on one output are not kept apart
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]

RESUMABLE_SUFFIX = ".partial"


def resumable_scratch(output: Path) -> Path:
    return output.with_name(f".{output.name}{RESUMABLE_SUFFIX}")


class StagedFolder:
    """``with StagedFolder(output) as stage: ...write into stage.path...; stage.publish()``; ``output`` has passed
    ``check_output`` already. Resumable (mirrorsd-export --resume): the scratch folder is ``.NAME.partial``, kept
    when the run stops and continued by the next resumable run."""

    def __init__(self, output: Path, resumable: bool = False) -> None:
        self.output, self.resumable = Path(output), resumable
        self.path: Path | None = None
        self._lock = None

    def __enter__(self) -> "StagedFolder":
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            if self.resumable:
                self.path = resumable_scratch(self.output)
                self.path.mkdir(exist_ok=True)
                self._hold_lock()
            else:
                self.path = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.partial-", dir=self.output.parent))
        except OSError as exc:
            raise write_error(self.output, exc, kept=None) from exc
        return self

    def _hold_lock(self) -> None:
        if fcntl is None:
            return
        self._lock = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise OutputFolderError(f"Another export is writing '{self.path}'", "two runs would mix their files",
                                    "wait for the other run to finish, or stop it first") from None

    def __exit__(self, kind, exc, tb) -> bool:
        if self._lock is not None:
            os.close(self._lock)
        if exc is None or self.path is None:
            return False
        if not self.resumable:
            shutil.rmtree(self.path, ignore_errors=True)
        if isinstance(exc, OSError):  # disk full, quota, permissions: the user's to fix, not a crash
            raise write_error(self.output, exc, kept=self.path if self.resumable else None) from exc
        return False

    def publish(self) -> Path:
        """Rename the finished scratch folder into place; a replaced folder is removed only after the swap."""
        publish(self.path, self.output)
        return self.output


@contextlib.contextmanager
def staged(output: Path) -> Iterator[Path]:
    """Yield a fresh scratch folder beside ``output``; on success publish it as ``output`` (replacing an old folder
    only after the swap), on any error remove it and leave ``output`` as it was. OSError -> OutputFolderError."""
    with StagedFolder(output) as stage:
        yield stage.path
        stage.publish()


def write_error(output: Path, exc: OSError, kept: Path | None = None) -> OutputFolderError:
    """``kept``: a resumable scratch folder that holds the finished work (mirrorsd-export --resume)."""
    left = (f"the finished graphs are kept in '{kept}': run again with --resume" if kept is not None else
            "nothing was left behind; an existing folder is untouched")
    return OutputFolderError(f"Could not write '{output}'", exc.strerror or str(exc),
                             f"{remedy(exc)}, then run again ({left})")


def remedy(exc: OSError) -> str:
    """What to do about an OSError while writing, by its cause: disk space only when the disk is full."""
    import errno

    return {errno.ENOSPC: "free some disk space or pick another --output",
            errno.EDQUOT: "free some of your disk quota or pick another --output",
            errno.EROFS: "the file system is read-only: pick an --output on a writable one",
            errno.ENAMETOOLONG: "pick a shorter --output name (the file system limits a name's length)",
            errno.EACCES: "pick an --output in a folder you may write to",
            errno.EPERM: "pick an --output in a folder you may write to",
            errno.ENOTDIR: "a file stands where a folder of the path should be: pick another --output",
            errno.ELOOP: "the path leads into a loop of symbolic links: pick another --output",
            }.get(exc.errno, "pick another --output")


def publish(scratch: Path, output: Path, terminated: bool = False) -> None:
    """Rename the finished scratch folder into place; a replaced folder is removed only after the swap.
    ``terminated``: publish even though the run was stopped (a resumable state the stop itself saved)."""
    if not terminated:
        raise_if_terminated()  # a SIGTERM that a library swallowed still stops the run before anything is published
    os.chmod(scratch, _mkdir_mode(scratch))  # mkdtemp's folder is private (0700); publish it as mkdir would
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.replaced-{os.getpid()}")
        os.replace(output, old)
    try:
        os.replace(scratch, output)
    except BaseException:
        if old is not None:
            os.replace(old, output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _mkdir_mode(inside: Path) -> int:
    """The permissions a plain mkdir gives (the umask applied), read without changing the process umask."""
    probe = inside / ".mode-probe"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    return mode


def copy_file(src: Path, dst: Path) -> None:
    # A copy, not a hard link: onnx refuses external data with several links ("hardlink attack"), and a link
    # would let a later write into one folder change the other.
    shutil.copy2(src, dst)
