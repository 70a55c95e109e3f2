"""One definition per setting: every CLI flag that names a settings field takes its default from the dataclass, and
SpecBench is read (and held out) by one module for the bench and the trainer."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mirrorsd import specbench
from mirrorsd.apps.bench import BenchOptions
from mirrorsd.errors import ExportOptionError, GenerationInputError
from mirrorsd.export.options import ExportOptions
from mirrorsd.export.streaming.options import TrainOptions
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.config import MirrorSettings

def parsed(command: str, argv: list[str]):
    from mirrorsd.apps.cli import build_parser
    from mirrorsd.export.cli import build_parser as export_parser
    from mirrorsd.export.streaming.cli import build_parser as train_parser

    return {"export": export_parser, "train": train_parser}.get(command, build_parser)().parse_args(argv)


def built(command: str, argv: list[str]):
    """The settings object a command builds from ``argv``."""
    from mirrorsd.apps.cli import bench_options, generation_config
    from mirrorsd.export.cli import export_options
    from mirrorsd.export.streaming.cli import train_options

    make = {"generate": generation_config, "bench": bench_options, "export": export_options, "train": train_options}
    return make[command](parsed(command, argv))


def test_without_flags_every_command_uses_the_dataclass_defaults():
    assert built("generate", ["generate", "--model", "m", "--prompt", "p"]) == GenerationConfig()
    assert built("bench", ["bench", "--model", "m"]) == BenchOptions(model=Path("m"))
    assert built("export", ["--model", "m", "--output", "o"]) == ExportOptions(model=Path("m"), output=Path("o"))
    assert built("train", ["--draft", "d", "--target", "t", "--output", "o"]) == \
        TrainOptions(draft=Path("d"), target=Path("t"), output=Path("o"))


@pytest.mark.parametrize("command, argv, cls", [
    ("generate", ["generate", "--model", "m", "--prompt", "p"], GenerationConfig),
    ("bench", ["bench", "--model", "m"], BenchOptions),
    ("export", ["--model", "m", "--output", "o"], ExportOptions),
    ("train", ["--draft", "d", "--target", "t", "--output", "o"], TrainOptions)])
def test_flags_are_named_after_the_fields(command, argv, cls):
    args = vars(parsed(command, argv))
    named = {f.name for f in dataclasses.fields(cls)} & set(args)
    assert len(named) >= 0.6 * len(dataclasses.fields(cls)), (command, sorted(named))


def test_flags_reach_the_settings():
    config = built("generate", ["generate", "--model", "m", "--prompt", "p", "--raw", "--no-exit-head", "--branches",
                                "6", "--greedy", "--no-streaming", "--mode", "sd"])
    assert config == GenerationConfig(chat=False, exit_head=False, branches=6, do_sample=False, streaming=False,
                                      mode="sd")
    options = built("export", ["--model", "m", "--output", "o", "--precision", "int8", "--draft-precision", "int4"])
    assert (options.target_precision, options.draft_precision) == ("int8", "int4")
    assert built("train", ["--draft", "d", "--target", "t", "-o", "o", "--train-prompts", "0"]).train_prompts is None


def test_bench_defaults_follow_the_generation_defaults():
    for name in ("max_new_tokens", "gamma", "branches", "branch_batch"):
        assert getattr(BenchOptions(model=Path("m")), name) == getattr(GenerationConfig(), name)


def test_mirror_settings_are_the_generation_configs_own_fields():
    config = GenerationConfig(branches=3, branch_budget="cap", exit_head=False, draft_timeout_s=5.0)
    assert config.mirror == MirrorSettings(branches=3, branch_budget="cap", exit_head=False, draft_timeout_s=5.0)
    assert {f.name for f in dataclasses.fields(MirrorSettings)} < {f.name for f in dataclasses.fields(config)}


def test_the_manifest_schema_lists_the_precisions():
    from mirrorsd.names import PRECISIONS

    schema = json.loads((Path(__file__).parent.parent / "docs" / "manifest.schema.json").read_text())
    text = json.dumps(schema)
    assert text.count(json.dumps(list(PRECISIONS))) == 2  # target_precision and draft_precision


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hold_out_rule_and_the_bench_prompts(tmp_path):
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}", "second turn"]} for i in range(24)]
    questions = specbench.read(write(tmp_path / "q.jsonl", rows))
    assert [q.text for q in questions[:3]] == ["q0", "q1", "q2"]
    train, held = specbench.held_out(questions)
    assert len(held) == 2 * specbench.HOLDOUT and len(train) == 24 - 2 * specbench.HOLDOUT
    for category in "ab":  # the first HOLDOUT of each category, in file order
        assert [q for q in held if q.category == category] == [q for q in questions if q.category == category][:5]
    prompts = specbench.first_per_category(questions, (), specbench.HOLDOUT)
    assert set(prompts) <= set(held) and [q.category for q in prompts] == ["a"] * 5 + ["b"] * 5
    assert not set(specbench.first_per_category(questions, ("b",), 6)) <= set(held)  # past the hold-out
    with pytest.raises(GenerationInputError, match="Unknown SpecBench categories"):
        specbench.first_per_category(questions, ("c",), 1)


@pytest.mark.parametrize("line", ["not json", json.dumps({"question_id": 1, "turns": ["x"]}),
                                  json.dumps({"question_id": 1, "category": "a", "turns": []}),
                                  json.dumps([1, 2])])
def test_a_bad_question_file_is_an_error_of_the_bench_and_of_the_trainer(tmp_path, line):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 0, "category": "a", "turns": ["fine"]}) + "\n" + line + "\n")
    for flag, kind in (("--questions", GenerationInputError), ("--prompts", ExportOptionError)):
        with pytest.raises(kind, match="line 2") as info:
            specbench.read(path, flag)
        assert flag in str(info.value)
    with pytest.raises(specbench.QuestionFileError, match="Cannot read"):
        specbench.read(tmp_path / "missing.jsonl")


def test_the_shipped_specbench_questions_load_and_are_package_data(monkeypatch):
    monkeypatch.delenv(specbench.ENV, raising=False)
    path = specbench.default_path()
    assert path == specbench.shipped_path() and (path.parent / "LICENSE").is_file()  # the licence travels with it
    questions = specbench.read()
    assert len(questions) == 480 and len({q.question_id for q in questions}) == 480
    prompts = specbench.first_per_category(questions, (), specbench.HOLDOUT)
    assert [q.category for q in prompts] == [c for c in specbench.DEFAULT_CATEGORIES for _ in range(specbench.HOLDOUT)]
    import tomllib  # a wheel ships only what package-data lists

    config = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    shipped = config["tool"]["setuptools"]["package-data"]["mirrorsd"]
    assert {"data/spec_bench/question.jsonl", "data/spec_bench/LICENSE"} <= set(shipped)


def test_bench_questions_flag_and_the_environment_override(tmp_path, monkeypatch):
    from mirrorsd.apps.cli import bench_options, build_parser

    mine = write(tmp_path / "mine.jsonl", [{"question_id": "x", "category": "qa", "turns": ["Why?"]}])
    args = build_parser().parse_args(["bench", "--model", str(tmp_path), "--questions", str(mine)])
    options = bench_options(args)
    assert options.questions == mine and [q.text for q in specbench.read(options.questions)] == ["Why?"]
    default = bench_options(build_parser().parse_args(["bench", "--model", str(tmp_path)]))
    assert default.questions is None  # read() then takes default_path()
    monkeypatch.setenv(specbench.ENV, str(mine))
    assert [q.question_id for q in specbench.read(default.questions)] == ["x"]
    monkeypatch.setenv(specbench.ENV, str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(specbench.QuestionFileError, match="MIRRORSD_SPEC_BENCH"):
        specbench.read()
