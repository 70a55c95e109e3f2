"""``mirrorsd generate --prompt-file``: a prompt read from a file or standard input (a command line holds at most
128 KiB per argument on Linux), the same tokens as --prompt, and a clear error, before any model loads, for a path
that cannot be read or text that is not UTF-8."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from mirrorsd.apps.cli import main, read_prompt_file

TEXT = "Write a short poem about the sea.\nKeep it to four lines."


def generated(capsys, folder, *source: str) -> list[int]:
    assert main(["generate", "--model", str(folder), *source, "--mode", "ar", "--max-new-tokens", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["tokens"]


def test_a_prompt_file_gives_the_tokens_of_the_same_prompt(exported, tmp_path, capsys, monkeypatch):
    folder = exported("llama", draft_layers=2)
    path = tmp_path / "prompt.txt"
    path.write_text(TEXT + "\n", encoding="utf-8")  # the newline an editor adds is dropped
    expected = generated(capsys, folder, "--prompt", TEXT)
    assert generated(capsys, folder, "--prompt-file", str(path)) == expected
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TEXT.encode("utf-8"))))
    assert generated(capsys, folder, "--prompt-file", "-") == expected


def test_only_one_trailing_newline_is_dropped(tmp_path):
    for written, read in (("a\n", "a"), ("a\r\n", "a"), ("a\n\n", "a\n"), ("a", "a"), ("", "")):
        path = tmp_path / "p.txt"
        path.write_bytes(written.encode("utf-8"))
        assert read_prompt_file(path) == read


def test_an_endless_or_huge_prompt_file_is_refused_after_a_bounded_read(tmp_path, monkeypatch):
    from mirrorsd.apps import cli
    from mirrorsd.errors import GenerationInputError

    monkeypatch.setattr(cli, "PROMPT_FILE_LIMIT", 1024)
    with pytest.raises(GenerationInputError, match="more than"):
        read_prompt_file(Path("/dev/zero"))  # never ends: read only to the bound
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * 1025)
    with pytest.raises(GenerationInputError, match="more than"):
        read_prompt_file(big)
    big.write_bytes(b"a" * 1024)
    assert read_prompt_file(big) == "a" * 1024


@pytest.mark.parametrize("case", ["missing", "folder", "latin-1"])
def test_a_bad_prompt_file_is_a_clear_error_before_loading(case, tmp_path, capsys):
    path = {"missing": tmp_path / "nope.txt", "folder": tmp_path, "latin-1": tmp_path / "p.txt"}[case]
    if case == "latin-1":
        path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    # the model folder does not exist either: the prompt is read first, so its error is the one reported
    code = main(["generate", "--model", str(tmp_path / "no-export"), "--prompt-file", str(path)])
    err = capsys.readouterr().err
    assert code != 0
    if case == "latin-1":
        assert "is not UTF-8 text" in err and "byte 3" in err, err
    else:
        assert "Cannot read --prompt-file" in err and str(path) in err, err
    assert "Traceback" not in err


def test_prompt_and_prompt_file_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--model", "m", "--prompt", "p", "--prompt-file", str(tmp_path / "p.txt")])
    assert stop.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m"])
    assert "one of the arguments --prompt --prompt-file is required" in capsys.readouterr().err
