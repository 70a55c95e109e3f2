"""An output folder appears whole or not at all: it is built in a hidden scratch folder beside it and renamed.

    .NAME.partial-XXXXXXXX/   a fresh scratch folder, removed on any failure (Ctrl-C included)
    .NAME.partial/            the resumable one (``resumable=True``, mirrorsd-export --resume): kept when the run
                              stops, continued by the next resumable run, renamed into place like the other
    NAME/                     appears by one rename once complete; an old NAME (--force) is swapped out first and
                              deleted only after the new one is in place

The export pipeline and ``mirrorsd quantize`` both publish through ``StagedFolder``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mirrorsd.errors import OutputFolderError

try:  # POSIX only; on Windows two resumable runs on one output are not kept apart
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]

RESUMABLE_SUFFIX = ".partial"


def check_output(output: Path, force: bool) -> None:
    """Refuse an output that is a file, or a non-empty folder without ``force``."""
    if output.exists() and not output.is_dir():
        raise OutputFolderError(f"Output '{output}' is a file", "the export writes a folder", "pick another --output")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise OutputFolderError(f"Output folder '{output}' is not empty", "exports never overwrite without asking",
                                "pick another --output, or pass --force to replace it")


def resumable_scratch(output: Path) -> Path:
    return output.with_name(f".{output.name}{RESUMABLE_SUFFIX}")


class StagedFolder:
    """``with StagedFolder(output, force) as scratch: ...write into scratch...; stage.publish()``."""

    def __init__(self, output: Path, force: bool, resumable: bool = False) -> None:
        self.output, self.force, self.resumable = Path(output), force, resumable
        check_output(self.output, force)
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
        os.chmod(self.path, _mkdir_mode(self.path))  # mkdtemp's folder is private (0700): publish as mkdir would
        old = None
        if self.output.exists():
            old = self.output.with_name(f".{self.output.name}.replaced-{os.getpid()}")
            os.replace(self.output, old)
        try:
            os.replace(self.path, self.output)
        except BaseException:
            if old is not None:
                os.replace(old, self.output)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.output


def write_error(output: Path, exc: OSError, kept: Path | None) -> OutputFolderError:
    left = (f"the finished graphs are kept in '{kept}': run again with --resume" if kept is not None else
            "nothing was left behind; an existing folder is untouched")
    return OutputFolderError(f"Could not write the export folder '{output}'", exc.strerror or str(exc),
                             f"free some disk space or pick another --output, then export again ({left})")


def _mkdir_mode(inside: Path) -> int:
    """The permissions a plain mkdir gives (the umask applied), read without changing the process umask."""
    probe = inside / ".mode-probe"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    return mode
