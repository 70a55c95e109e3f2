"""How every mirrorsd command ends: one what/why/fix line and an exit code, never a traceback for the user's input.

    run_command(body, interrupted)   MirrorSDError -> "error: ..." (its exit code); Ctrl-C -> 130; SIGTERM -> 143
                                     (raised as Terminated, a KeyboardInterrupt, so the same cleanup runs: scratch
                                     folders are removed); stdout closed by its reader (`| head`) -> a quiet 0
    raise_if_terminated()            raise Terminated if SIGTERM arrived, even when a library swallowed the first
                                     raise (numpy's lazy imports do): called before anything is published
    write_stdout(text)               print to stdout; a full disk or a broken device is an OutputStreamError
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

from mirrorsd.errors import MirrorSDError, OutputStreamError

SIGTERM_EXIT = 128 + signal.SIGTERM
SIGINT_EXIT = 128 + signal.SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C (every ``except BaseException`` cleanup runs), reported as such."""


_terminated = threading.Event()  # set by the handler: whatever the unwinding turns into, the run was terminated


def _on_sigterm(signum, frame) -> None:
    _terminated.set()
    raise Terminated()


def raise_if_terminated() -> None:
    """The handler's raise can land inside library code that swallows it (a Cython module's import does): the flag
    it set is what decides whether the run was terminated."""
    if _terminated.is_set():
        raise Terminated()


def run_command(body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command's body and turn every way it can end into an exit code (see the module doc)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        _terminated.clear()
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = body()
        raise_if_terminated()
        write_stdout("")  # flush now: a write error surfaces here, not in the interpreter's exit
        return code
    except BaseException as exc:  # noqa: BLE001 - every ending is mapped below; anything else is re-raised
        return _ending(exc, interrupted)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _ending(exc: BaseException, interrupted: str) -> int:
    _close_progress_bars()  # the line below starts a line of its own, never the end of a bar's
    if _terminated.is_set():  # a signal can land inside an import or a library call and surface as its error
        print(f"terminated{interrupted.removeprefix('interrupted')}", file=sys.stderr)
        return SIGTERM_EXIT
    if isinstance(exc, MirrorSDError):
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print(interrupted, file=sys.stderr)
        return SIGINT_EXIT
    if isinstance(exc, BrokenPipeError):  # the reader went away (`mirrorsd generate ... | head`): not our error
        _stdout_to_devnull()
        return 0
    raise exc


def _close_progress_bars() -> None:
    """Close every progress bar still open (the error unwound past its close): each ends its line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error being reported
            pass


def write_stdout(text: str) -> None:
    """Write and flush ``text``; BrokenPipeError passes (run_command ends quietly), other failures are errors."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _stdout_to_devnull()  # else the interpreter's own flush at exit fails again, with a traceback
        raise OutputStreamError("Could not write to stdout", exc.strerror or str(exc),
                                "redirect the output to a place with room (or drop the redirection)") from None


def _stdout_to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (embedded, pytest capture): nothing will flush to it
        pass
