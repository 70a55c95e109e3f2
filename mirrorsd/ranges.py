"""The ranges of a command's numeric options, as one table per command, checked before any work starts.

    Range(low, high, above=False)        low <= value <= high (``above``: low itself excluded, e.g. lr > 0); a
                                         high of None is no upper bound; NaN and infinity never pass
    check(options, table, error)         every field of ``options`` named in ``table`` (None: left to its
                                         default) in its range, else ``error`` naming the flag (--field-name)

A range says what a value can mean, not what is wise: counts start at 1, rates and times above 0, thread counts
stop at the cores this process may use (more only queue, and a million of them never finish starting), and sizes
that allocate stop far above any real run but below what would exhaust the machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mirrorsd.errors import MirrorSDError


@dataclass(frozen=True)
class Range:
    low: float
    high: float | None = None
    above: bool = False  # low excluded: value > low

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return (value > self.low if self.above else value >= self.low) and (self.high is None or value <= self.high)

    def words(self) -> str:
        low = f"above {self.low:g}" if self.above else f"at least {self.low:g}"
        return low if self.high is None else f"{low} and at most {self.high:g}"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(options, table: dict[str, Range], error: type[MirrorSDError]) -> None:
    """Raise ``error`` for the first field of ``options`` in ``table`` whose value is outside its range."""
    for name, allowed in table.items():
        value = getattr(options, name)
        if value is None or allowed.holds(value):
            continue
        raise error(f"{flag(name)} {value!r} is out of range", f"it must be {allowed.words()}",
                    f"pass {flag(name)} {allowed.words()}, or leave it out (its default)")


def cores() -> int:
    """The cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads() -> Range:
    """Threads of a session or of torch: 1 .. the cores this process may run on."""
    return Range(1, cores())


SEED = Range(0, 2**32 - 1)  # NumPy's and Python's seeding both take it
