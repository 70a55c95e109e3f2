"""Device profiles: what each graph costs on each device and thread split, as a small JSON file.

A measured profile (``mirrorsd devices --profile --model EXPORT``, runtime/planner/profiling.py) is cached per export
and device set under ``<cache>/profiles/`` (``<cache>`` = ``$MIRRORSD_CACHE`` or ``~/.cache/mirrorsd``; or
``$MIRRORSD_PROFILES``). A hand-written one describes a machine we do not have (docs/profiles/*.json,
``mirrorsd plan --profile FILE``). The schema is documented in docs/profile.md; loading rejects unknown keys and other
schema versions.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from mirrorsd.errors import ProfileError
from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts
from mirrorsd.runtime.planner.stops import StopCounts

SCHEMA = "mirrorsd-profile/1"
CACHE_ENV = "MIRRORSD_PROFILES"  # a folder for cached profiles instead of <cache>/profiles (tests use a tmp one)
KINDS = ("measured", "hand-written")


@dataclass(frozen=True)
class Profile:
    kind: str  # "measured" on this machine, or "hand-written" from published numbers (a what-if)
    machine: str  # in words
    splits: tuple[SplitCosts, ...]
    acceptance: Acceptance | None = None  # the pair's calibration (None: not measured)
    calibration: dict = field(default_factory=dict)  # how acceptance was measured (prompt tokens, gamma, ...)
    detail: tuple[dict, ...] = ()  # per split: per-graph timings behind the costs (prefix, suffix, host, ...)
    export: dict = field(default_factory=dict)  # folder, manifest sha256, placement (measured profiles)
    sources: tuple[str, ...] = ()  # where a hand-written profile's numbers come from
    notes: tuple[str, ...] = ()
    created: str = ""

    def split(self, target_threads: int, draft_threads: int, shared_pool: bool = False) -> SplitCosts | None:
        return next((s for s in self.splits if not s.name and s.key == (target_threads, draft_threads, shared_pool)),
                    None)

    def with_split(self, costs: SplitCosts, detail: dict) -> "Profile":
        """This profile with ``costs`` added (replacing a split measured before with the same threads)."""
        keep = [(s, d) for s, d in zip(self.splits, self.detail or ({},) * len(self.splits))
                if s.split != costs.split]
        keep.append((costs, detail))
        return Profile(**{**self.__dict__, "splits": tuple(s for s, _ in keep), "detail": tuple(d for _, d in keep),
                          "created": now()})

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "kind": self.kind, "machine": self.machine, "created": self.created,
                "export": self.export, "sources": list(self.sources), "notes": list(self.notes),
                "splits": [{**_costs_json(s), "detail": d}
                           for s, d in zip(self.splits, self.detail or ({},) * len(self.splits))],
                "acceptance": None if self.acceptance is None else {
                    "alpha": self.acceptance.alpha, "reuse": self.acceptance.reuse,
                    "reuse_noexit": self.acceptance.reuse_noexit, "source": self.acceptance.source,
                    "stops": [c.to_list() for c in self.acceptance.stops]},
                "calibration": self.calibration}


def _costs_json(costs: SplitCosts) -> dict:
    out = {}
    for f in fields(SplitCosts):
        value = getattr(costs, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


TOP_KEYS = {"schema", "kind", "machine", "created", "export", "sources", "notes", "splits", "acceptance",
            "calibration"}
SPLIT_KEYS = {f.name for f in fields(SplitCosts)} | {"detail"}
ACCEPTANCE_KEYS = {"alpha", "reuse", "reuse_noexit", "source", "stops"}


def from_json(data: dict, where: str = "profile") -> Profile:
    """A Profile from its JSON form; ProfileError on another schema, unknown keys or bad numbers."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ProfileError(f"{where} is not a {SCHEMA} profile", f"its schema is {found!r}",
                           "re-measure it with `mirrorsd devices --profile --model EXPORT`, or follow "
                           "docs/profile.md")
    _keys(data, TOP_KEYS, where)
    if data.get("kind") not in KINDS:
        raise ProfileError(f"{where}: kind {data.get('kind')!r} is unknown", f"it is one of {', '.join(KINDS)}",
                           "fix the file")
    splits, detail = [], []
    for i, entry in enumerate(data.get("splits") or []):
        _keys(entry, SPLIT_KEYS, f"{where} splits[{i}]")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items() if k != "detail"}
        try:
            costs = SplitCosts(**values)
        except TypeError as exc:
            raise ProfileError(f"{where} splits[{i}] is incomplete", str(exc), "see docs/profile.md") from None
        _check_costs(costs, f"{where} splits[{i}]")
        splits.append(costs)
        detail.append(entry.get("detail") or {})
    if not splits:
        raise ProfileError(f"{where} has no splits", "a profile needs the costs of at least one thread split",
                           "see docs/profile.md")
    acc = data.get("acceptance")
    acceptance = None
    if acc is not None:
        _keys(acc, ACCEPTANCE_KEYS, f"{where} acceptance")
        try:
            stops = tuple(StopCounts.from_list(item) for item in acc.get("stops") or ())
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"{where} acceptance.stops is malformed", f"{type(exc).__name__}: {exc}",
                               "each entry is [gamma, threshold, tokens, [steps per window length]]; fix the file, "
                               "or re-measure it") from exc
        acceptance = Acceptance(float(acc["alpha"]), float(acc["reuse"]),
                                None if acc.get("reuse_noexit") is None else float(acc["reuse_noexit"]),
                                str(acc.get("source", "profile")), stops=stops)
        rates = (acceptance.alpha, acceptance.reuse, acceptance.reuse_for(False))
        if not all(0.0 <= r <= 1.0 for r in rates):  # NaN fails this too
            raise ProfileError(f"{where} acceptance is out of range", f"alpha and reuse are probabilities, 0..1 "
                               f"(got {rates})", "fix the file, or re-measure it")
    return Profile(kind=data["kind"], machine=str(data.get("machine", "")), splits=tuple(splits),
                   acceptance=acceptance, calibration=dict(data.get("calibration") or {}), detail=tuple(detail),
                   export=dict(data.get("export") or {}), sources=tuple(data.get("sources") or ()),
                   notes=tuple(data.get("notes") or ()), created=str(data.get("created", "")))


def _keys(data, allowed: set[str], where: str) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} is not an object", f"got {type(data).__name__}", "see docs/profile.md")
    unknown = set(data) - allowed
    if unknown:
        raise ProfileError(f"{where} has unknown keys {sorted(unknown)}", f"the keys are {sorted(allowed)}",
                           "fix the file, or re-measure it")


def _check_costs(costs: SplitCosts, where: str) -> None:
    times = [*costs.verify_s, *costs.exit_s, costs.draft1_s, costs.branch_fwd_s, *costs.stream_window_s]
    if len(costs.verify_s) < 2 or len(costs.exit_s) != len(costs.verify_s):
        raise ProfileError(f"{where}: verify_s and exit_s need one entry per window width 1 .. gamma + 1",
                           f"got {len(costs.verify_s)} and {len(costs.exit_s)}", "see docs/profile.md")
    if any(not isinstance(t, (int, float)) or not 0 <= t < math.inf for t in times) or costs.verify_s[0] <= 0:
        raise ProfileError(f"{where}: every time must be a number of seconds >= 0", "a step cannot take less",
                           "fix the file")
    if costs.prefix_s and (len(costs.prefix_s) != len(costs.verify_s) or any(
            not isinstance(p, (int, float)) or not 0 <= p <= v for p, v in zip(costs.prefix_s, costs.verify_s))):
        raise ProfileError(f"{where}: prefix_s needs one time per window width, each within verify_s",
                           "the prefix is part of the verification", "fix the file, or leave prefix_s out")
    if not 1.0 <= costs.c_target < math.inf or not 1.0 <= costs.c_draft < math.inf:
        raise ProfileError(f"{where}: contention factors are finite numbers >= 1", "1.0 means no slowdown",
                           "fix the file")


def load(path: Path) -> Profile:
    """The profile in file ``path``; ProfileError when it is missing, not a regular file, implausibly large, not
    JSON, nested too deeply, or not a profile of this schema (wrong keys or types)."""
    from mirrorsd.user_files import JSON_LIMIT, read_json

    path = Path(path)
    if not os.path.lexists(path):
        raise ProfileError(f"Profile {path} does not exist", "nothing was measured or written there",
                           "measure one with `mirrorsd devices --profile --model EXPORT`")
    data = read_json(path, JSON_LIMIT, lambda why: ProfileError(f"Cannot read the profile {path}", why,
                                                                "fix the file, or re-measure it"))
    try:
        return from_json(data, str(path))
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a value of the wrong type somewhere inside
        raise ProfileError(f"{path} is not a {SCHEMA} profile", f"a value has the wrong type ({exc})",
                           "fix the file, or re-measure it") from None


def save(profile: Profile, path: Path) -> Path:
    """Write ``profile`` to ``path`` atomically (a scratch file renamed into place); OSError passes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_or_say(profile: Profile, path: Path, say=None) -> bool:
    """Cache ``profile`` at ``path``; where the cache cannot be written (a read-only file system, a file where the
    folder goes, no space), say so in one line and go on with the profile in memory. True when saved."""
    try:
        save(profile, path)
        _UNSAVED.pop(str(path), None)
        return True
    except OSError as exc:
        first = not _UNSAVED
        _UNSAVED[str(path)] = profile
        if first:
            (say or _say)(f"the measured profile could not be saved to {path.parent} ({os_words(exc)}); it is "
                          f"used from memory by this process only (set ${CACHE_ENV} to a writable folder to keep it)")
        return False


_UNSAVED: dict[str, Profile] = {}  # cache path -> a profile this process measured and could not save


def unsaved(path: Path) -> Profile | None:
    """The profile this process measured for cache ``path`` and could not save (a read-only cache), or None."""
    return _UNSAVED.get(str(path))


def os_words(exc: OSError) -> str:
    """What an OSError means, in words (its strerror), e.g. 'Read-only file system'."""
    return exc.strerror or type(exc).__name__


def _say(line: str) -> None:
    """One line on the profile's logger: a warning, which Python prints on stderr when nothing is set up."""
    import logging

    logging.getLogger("mirrorsd.runtime.planner.profile").warning(line)


def cache_path(folder: Path, placement: dict[str, str]) -> Path:
    """Where the measured profile of export ``folder`` on this device set is cached: one file per export (by its
    manifest's hash) and placement (what runs each graph, kernels included, and for mirrorsd's kernels which build
    and path: a rebuilt kernel library is measured again; and whether ONNX Runtime's own pools spin within a run);
    every thread split lives inside, the shared pool's included."""
    from mirrorsd.devices.placement import KERNELS_MARK, SHARED_POOL_MARK
    from mirrorsd.names import MANIFEST_FILE

    folder = Path(folder).resolve()
    # the thread pool is part of the split (SplitCosts.shared_pool), not of the placement: one file holds both
    placement = {role: where.replace(SHARED_POOL_MARK, "") for role, where in placement.items()}
    digest = hashlib.sha256((folder / MANIFEST_FILE).read_bytes())
    digest.update(json.dumps(sorted(placement.items())).encode())
    if any(KERNELS_MARK in where for where in placement.values()):
        from mirrorsd.devices import kernels

        digest.update(str(kernels.build_id()).encode())
    digest.update(str(folder).encode())
    return cache_root() / f"{folder.name}-{digest.hexdigest()[:16]}.json"


def cache_root() -> Path:
    from mirrorsd.weights import default_cache_dir

    return Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else default_cache_dir() / "profiles"


def cached_by_devices(folder: Path) -> dict[tuple[str, str], Profile]:
    """The cached measured profiles of export ``folder``, by the (target, draft) device strings their sessions ran
    on (as profiling.profile_for records them). A file counts only while its recorded placement still hashes to its
    own name: the same manifest, folder and kernel build (a stale one is measured again, not ranked)."""
    folder = Path(folder).resolve()
    found: dict[tuple[str, str], Profile] = {}
    root = cache_root()
    try:
        paths = set(root.glob(f"{folder.name}-*.json"))
    except OSError:  # an unreadable cache folder holds nothing we can use
        paths = set()
    paths |= {Path(p) for p in _UNSAVED if Path(p).parent == root and Path(p).name.startswith(f"{folder.name}-")}
    for path in sorted(paths):
        profile = unsaved(path)
        try:
            profile = profile or load(path)
        except ProfileError as exc:
            skipped(path, exc)
            continue
        export = profile.export
        devices = export.get("devices") or {}
        if set(devices) == {"target", "draft"} and export.get("folder") == str(folder) and \
                cache_path(folder, export.get("placement") or {}) == path:
            found.setdefault((devices["target"], devices["draft"]), profile)
    return found


_SKIPPED: set[str] = set()  # cache files already reported in this process: one line each, not one per look-up


def skipped(path: Path, exc: ProfileError) -> None:
    """Say once per process that a cached profile is unusable and is ignored (it is measured again if needed)."""
    if str(path) in _SKIPPED:
        return
    _SKIPPED.add(str(path))
    _say(f"ignoring the cached profile {path}: {exc.why or exc.what} (it is measured again when needed)")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
