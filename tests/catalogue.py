"""The reliability catalogue's harness: run one case as a new user would, and observe what it did.

A case prepares a workspace (copies of a tiny model and its export, plus whatever the case breaks), then runs one
command in a subprocess (the real CLI, or a few lines of Python) and observes:

    exit code, seconds, a Python traceback on stderr, the ``error:`` lines, files of the user that changed or
    vanished, scratch folders left behind (``.NAME.partial-*``, ``.NAME.replaced-*``), and a hard stop by timeout

``Outcome.problems(case)`` lists what is wrong with an outcome (empty = the case is handled); the tests assert it is
empty, and ``scripts/lab/reliability_table.py`` prints outcomes as the docs table (run it on an older checkout for the
"before" column). Cases live in ``catalogue_cases.py``.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from child_process import python_command

TOOLS = {"mirrorsd": "mirrorsd.apps.cli", "mirrorsd-export": "mirrorsd.export.cli",
         "mirrorsd-train-draft": "mirrorsd.export.streaming.cli", "mirrorsd-train-exit": "mirrorsd.export.early_exit.cli"}
MEMORY_LIMIT = 8 * 2**30  # address space of a case's process: a hostile case must fail, not take the machine
LEFTOVER = re.compile(r"^\.[^/]+\.(partial|replaced)-")


@dataclass
class Run:
    """What a case runs: a tool and its arguments (or ``python`` and a script), where, and how stdout ends."""

    argv: list[str]
    cwd: Path
    stdout: str = "pipe"  # "pipe" | "closed" (the reader went away: `| head -c 0`) | "devfull" (a full disk)
    terminate_when: str | None = None  # send SIGTERM once this text shows on stderr (or this path exists)
    protect: list[Path] = field(default_factory=list)  # the user's files: must be there, unchanged, afterwards
    limit_s: float = 60.0  # bounded time: the case fails beyond this (and is killed at 2x)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment (e.g. a profile cache folder)

    def command(self) -> list[str]:
        """The Python command line, bounded to MEMORY_LIMIT bytes with SIGINT at its default (tests/child_process.py:
        a hostile case must hit a memory limit, not the machine; SIGINT as a shell leaves it)."""
        tool, *args = self.argv
        script = args if tool == "python" else ["-m", TOOLS[tool], *args]
        return python_command(*script, memory_limit=MEMORY_LIMIT)


@dataclass(frozen=True)
class Case:
    id: str
    issue: str  # the case's reference in the docs/reliability.md table (its "issue" column), e.g. "19.1"
    what: str  # the case in a few words, for the table
    setup: Callable[["Workspace"], Run]
    exit: str = "error"  # "error": a non-zero exit with one what/why/fix line | "ok": exit 0 | "terminated"
    says: tuple[str, ...] = ()  # phrases the error line (or, for "ok", stdout + stderr) must hold
    quiet: tuple[str, ...] = ()  # phrases stderr must not hold
    check: Callable[["Workspace", "Outcome"], str] | None = None  # extra check: returns a problem or ""


@dataclass
class Outcome:
    code: int | None
    seconds: float
    stdout: str
    stderr: str
    changed: list[str]  # protected files that vanished or changed
    leftovers: list[str]
    killed: bool  # the harness stopped it at 2x the limit

    @property
    def traceback(self) -> str:
        """The last line of a Python traceback on stderr, or ""."""
        if "Traceback (most recent call last)" not in self.stderr:
            return ""
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return lines[-1][:160] if lines else "?"

    @property
    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def problems(self, case: Case, workspace: "Workspace") -> list[str]:
        found = [text for _, text in self._facts()]
        if not self.killed and self.seconds > case_limit(case, workspace):
            found.append(f"took {self.seconds:.1f} s")
        found += self._exit_problems(case)
        if case.check is not None and not self.killed:
            try:
                extra = case.check(workspace, self)
            except Exception as exc:  # noqa: BLE001 - a check that cannot even look is a problem of the case
                extra = f"check failed: {type(exc).__name__}: {exc}"
            found += [extra] if extra else []
        return found

    def _facts(self) -> list[tuple[str, str]]:
        """What went wrong whatever the case expects: (short form for the table, long form for a test failure)."""
        facts = []
        if self.killed:
            facts.append((f"still running after {self.seconds:.0f} s (killed)", f"still running after "
                                                                               f"{self.seconds:.0f} s"))
        if self.traceback:
            facts.append((f"traceback `{self.traceback[:90]}`", f"traceback: {self.traceback}"))
        if self.changed:
            facts.append((f"**lost {', '.join(self.changed[:3])}**", f"lost or changed: {', '.join(self.changed[:4])}"))
        if self.leftovers:
            facts.append((f"**left {', '.join(self.leftovers[:2])}**", f"left behind: {', '.join(self.leftovers[:4])}"))
        return facts

    def _exit_problems(self, case: Case) -> list[str]:
        if case.exit == "ok":
            text = self.stdout + self.stderr
            missing = [p for p in case.says if p not in text]
            bad = [f"exit {self.code}"] if self.code != 0 else []
            return bad + [f"does not say {p!r}" for p in missing] + self._noisy(case)
        if case.exit == "terminated":
            return ([] if self.code == 128 + signal.SIGTERM else [f"exit {self.code}, not 143"]) + self._noisy(case)
        if self.code in (0, None):
            return [f"exit {self.code}" + (f"; said: {self.stderr.strip()[-120:]}" if self.stderr.strip() else "")]
        if len(self.errors) != 1:
            return [f"exit {self.code} with {len(self.errors)} error lines: {self.stderr.strip()[-160:]!r}"]
        line = self.errors[0]
        found = [] if "Why:" in line and "Fix:" in line else [f"no why/fix: {line[:160]}"]
        return found + [f"does not say {p!r}: {line[:200]}" for p in case.says if p not in line] + self._noisy(case)

    def _noisy(self, case: Case) -> list[str]:
        return [f"says {p!r}" for p in case.quiet if p in self.stderr]

    def summary(self) -> str:
        """One cell of the docs table."""
        facts = [short for short, _ in self._facts()]
        if self.killed:
            return facts[0]
        first = [] if self.traceback or not self.errors else [f"`{self.errors[0][:110]}`"]
        return "; ".join([f"exit {self.code}, {self.seconds:.1f} s", *first, *facts])


def case_limit(case: Case, workspace: "Workspace") -> float:
    return workspace.runs[case.id].limit_s if case.id in workspace.runs else 60.0


class Workspace:
    """A fresh folder per case, with copies of the shared fixtures (a tiny HF model and its export) on demand."""

    def __init__(self, root: Path, fixtures: dict[str, Path]) -> None:
        self.root, self.fixtures, self.runs = root, fixtures, {}
        root.mkdir(parents=True, exist_ok=True)

    def copy(self, fixture: str, to: str) -> Path:
        dest = self.root / to
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.fixtures[fixture], dest, symlinks=True)
        return dest

    def file(self, relative: str, text: str = "mine\n") -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path


def snapshot(paths: list[Path]) -> dict[str, str]:
    """relative name -> sha256 of every file under ``paths`` (symbolic links by their target)."""
    found = {}
    for top in paths:
        items = [top] if top.is_file() or top.is_symlink() else sorted(top.rglob("*"))
        for item in items:
            if item.is_symlink():
                found[str(item)] = "link:" + os.readlink(item)
            elif item.is_file():
                found[str(item)] = hashlib.sha256(item.read_bytes()).hexdigest()
        if not top.exists() and not top.is_symlink():
            found[str(top)] = "absent"
    return found


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if LEFTOVER.match(p.name))


def execute(case: Case, workspace: Workspace) -> Outcome:
    run = case.setup(workspace)
    workspace.runs[case.id] = run
    before = snapshot(run.protect)
    stdout = {"pipe": subprocess.PIPE, "closed": subprocess.PIPE,
              "devfull": open(os.devnull if not Path("/dev/full").exists() else "/dev/full", "wb")}[run.stdout]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", **run.env}
    env = {k: v for k, v in env.items() if v is not None}  # a case's None removes a variable
    started = time.perf_counter()
    proc = subprocess.Popen(run.command(), cwd=run.cwd, stdout=stdout, stderr=subprocess.PIPE, env=env)
    if run.stdout == "closed":
        proc.stdout.close()  # the reader is gone before the first byte: every write meets EPIPE
    out, err, killed = _wait(proc, run, started)
    seconds = time.perf_counter() - started
    after = snapshot(run.protect)
    changed = sorted(_relative(k, workspace.root) for k, v in before.items() if after.get(k) != v)
    return Outcome(proc.returncode, seconds, out, err, changed, leftovers(workspace.root), killed)


def _relative(path: str, root: Path) -> str:
    return str(Path(path).relative_to(root)) if Path(path).is_relative_to(root) else path


def _wait(proc: subprocess.Popen, run: Run, started: float) -> tuple[str, str, bool]:
    """Collect stderr line by line (to send SIGTERM on cue), stdout at the end; kill at 2x the limit."""
    import threading

    err_lines: list[str] = []

    def read_err():
        for raw in proc.stderr:
            err_lines.append(raw.decode("utf-8", "replace"))

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out_chunks: list[bytes] = []
    if run.stdout == "pipe":
        threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True).start()
    sent, killed = False, False
    while proc.poll() is None:
        if run.terminate_when and not sent and _cue(run, "".join(err_lines)):
            proc.send_signal(signal.SIGTERM)
            sent = True
        if time.perf_counter() - started > 2 * run.limit_s:
            proc.kill()
            killed = True
            break
        time.sleep(0.02)
    proc.wait()
    reader.join(timeout=10)
    deadline = time.perf_counter() + 10
    while run.stdout == "pipe" and not out_chunks and time.perf_counter() < deadline:
        time.sleep(0.02)
    return b"".join(out_chunks).decode("utf-8", "replace"), "".join(err_lines), killed


def _cue(run: Run, stderr: str) -> bool:
    cue = run.terminate_when
    if cue.startswith("glob:"):
        return any(run.cwd.glob(cue[5:]))
    return cue in stderr
