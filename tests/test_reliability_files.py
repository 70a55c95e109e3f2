"""Reading untrusted files, ranges of numbers, and the words of a failure (mirrorsd/user_files.py, mirrorsd/ranges.py,
mirrorsd/output_folder.remedy, mirrorsd/cli_exit): the parts of the reliability catalogue that need no subprocess."""
from __future__ import annotations

import errno
import os
import sys

import pytest

from mirrorsd.errors import MirrorSDError, OutputFolderError


def fail(why: str) -> MirrorSDError:
    return MirrorSDError("Cannot read it", why, "pass another file")


def test_read_text_refuses_what_is_not_a_small_regular_file(tmp_path):
    from mirrorsd.user_files import read_json, read_text

    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "ok.json", 100, fail) == {"a": 1}
    cases = {"folder": tmp_path, "device": "/dev/zero", "missing": tmp_path / "nope"}
    os.mkfifo(tmp_path / "fifo")  # nobody writes: a blocking open would hang
    cases["fifo"] = tmp_path / "fifo"
    (tmp_path / "big").write_text("x" * 101)
    cases["too large"] = tmp_path / "big"
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    cases["not UTF-8"] = tmp_path / "binary"
    (tmp_path / "loop").symlink_to("loop")
    cases["link loop"] = tmp_path / "loop"
    for what, path in cases.items():
        with pytest.raises(MirrorSDError, match="Cannot read it"):
            read_text(path, 100, fail)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MirrorSDError, match="nested too deeply"):
        read_json(tmp_path / "deep.json", 10**6, fail)


def test_ranges_refuse_nan_infinity_bools_and_the_ends():
    from dataclasses import dataclass

    from mirrorsd.ranges import Range, check

    @dataclass
    class Options:
        lr: float | None = None
        count: int | None = None

    table = {"lr": Range(0, 10, above=True), "count": Range(1, 5)}
    check(Options(lr=1e-3, count=5), table, MirrorSDError)
    check(Options(), table, MirrorSDError)  # None: left to the default
    for bad in (Options(lr=0.0), Options(lr=float("nan")), Options(lr=float("inf")), Options(count=0),
                Options(count=6), Options(count=True)):
        with pytest.raises(MirrorSDError, match="is out of range"):
            check(bad, table, MirrorSDError)


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "free some disk space"), (errno.EROFS, "read-only"),
                                         (errno.ENAMETOOLONG, "shorter"), (errno.EACCES, "may write")])
def test_write_errors_say_what_to_do_about_their_cause(code, words):
    from mirrorsd.output_folder import write_error

    error = write_error(__import__("pathlib").Path("out"), OSError(code, os.strerror(code)))
    assert isinstance(error, OutputFolderError) and words in error.fix
    assert code == errno.ENOSPC or "disk space" not in str(error)


def test_an_error_never_shares_a_line_with_a_progress_bar(capsys):
    """A bar the error unwound past is closed first: the error line starts a line of its own."""
    from tqdm import tqdm

    from mirrorsd.cli_exit import run_command

    def body() -> int:
        bar = tqdm(total=10, desc="working", file=sys.stderr, disable=False)
        bar.update(3)
        raise MirrorSDError("It broke", "a test", "none")

    assert run_command(body) == 2
    err = capsys.readouterr().err
    assert "\nerror: It broke" in err.replace("\r", "\n"), err
    line = next(part for part in err.split("\n") if "error:" in part)
    assert line.startswith("error:"), err
