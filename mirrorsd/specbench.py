"""SpecBench questions, read in one place for the bench and for every trainer, and the hold-out rule they share.

    file      question.jsonl: one JSON object a line with question_id, category and turns; the first turn is the
              prompt. Default: $MIRRORSD_SPEC_BENCH if set, else the copy shipped inside the package
              (mirrorsd/data/spec_bench/question.jsonl, Apache-2.0, see the README beside it); any other file of
              that shape through --questions PATH (bench) or --prompts PATH (trainers)
    hold-out  the first HOLDOUT = 5 questions of every category, in file order, are held out: a trainer never trains
              on them (mirrorsd-train-draft scores the draft on them before and after), and ``mirrorsd bench``
              takes its prompts from the first --per-category (default 2) of every category. So with
              --per-category <= 5 a benchmark never runs a prompt that a draft was trained on.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mirrorsd.errors import ExportOptionError, GenerationInputError

HOLDOUT = 5  # questions held out at the start of every category (see the module docstring)
# SpecBench's short-prompt categories. summarization and rag prompts run to hundreds of tokens: on a small CPU their
# prefill dominates a short benchmark run, so they are opt-in (--categories).
DEFAULT_CATEGORIES = ("writing", "coding", "reasoning", "math_reasoning", "qa", "translation")
FIELDS = ("question_id", "category", "turns")
ENV = "MIRRORSD_SPEC_BENCH"  # another default question file (a path)


class QuestionFileError(GenerationInputError, ExportOptionError):
    """A SpecBench question file is missing, unreadable or malformed (the bench's --questions, a trainer's
    --prompts): a bad input to either, so it is both kinds of error."""


@dataclass(frozen=True)
class Question:
    question_id: int | str  # as in the file
    category: str
    text: str  # the first turn


def shipped_path() -> Path:
    """The SpecBench question file installed with the package."""
    return Path(str(resources.files("mirrorsd") / "data" / "spec_bench" / "question.jsonl"))


def default_path() -> Path:
    """$MIRRORSD_SPEC_BENCH when set, else the shipped copy."""
    env = os.environ.get(ENV)
    path = Path(env) if env else shipped_path()
    if path.is_file():
        return path
    flags = "pass --questions PATH (bench) or --prompts PATH (trainer)"
    if env:
        raise QuestionFileError("SpecBench questions not found", f"${ENV} names '{path}', which is not a file",
                                f"{flags}, or point ${ENV} at a question.jsonl")
    raise QuestionFileError("SpecBench questions not found", f"the installed copy '{path}' is missing",
                            f"reinstall mirrorsd, or {flags}")


def read(path: Path | None = None, flag: str = "--questions") -> list[Question]:
    """Every question of ``path`` (default: ``default_path()``) in file order; ``flag`` names the option that gave
    the file, for the error message."""
    path = default_path() if path is None else Path(path)
    fix = f"pass {flag} PATH to a SpecBench question.jsonl"
    from mirrorsd.user_files import QUESTIONS_LIMIT, read_text

    lines = read_text(path, QUESTIONS_LIMIT, lambda why: QuestionFileError(
        f"Cannot read the questions file '{path}' ({flag})", why, fix)).splitlines()
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            row, why = None, f"line {number} is not JSON ({exc.msg})"
        except RecursionError:
            row, why = None, f"line {number} is JSON nested too deeply"
        else:
            why = f"line {number} lacks {', '.join(FIELDS[:-1])} or {FIELDS[-1]}"
        if not (isinstance(row, dict) and set(FIELDS) <= set(row) and isinstance(row["turns"], list)
                and row["turns"] and isinstance(row["turns"][0], str)):
            raise QuestionFileError(f"'{path}' is not a SpecBench question file", why, fix)
        questions.append(Question(row["question_id"], str(row["category"]), row["turns"][0]))
    return questions


def held_out(questions: list[Question], holdout: int = HOLDOUT) -> tuple[list[Question], list[Question]]:
    """(training, held-out) questions: the first ``holdout`` of every category are held out (file order)."""
    train, held, seen = [], [], {}
    for question in questions:
        seen[question.category] = seen.get(question.category, 0) + 1
        (held if seen[question.category] <= holdout else train).append(question)
    return train, held


def first_per_category(questions: list[Question], categories: tuple[str, ...], per_category: int) -> list[Question]:
    """The bench's prompts: the first ``per_category`` questions of each category (default: DEFAULT_CATEGORIES
    that the file has, else all of its categories), category by category."""
    available = list(dict.fromkeys(q.category for q in questions))
    wanted = categories or tuple(c for c in DEFAULT_CATEGORIES if c in available) or tuple(available)
    unknown = set(wanted) - set(available)
    if unknown:
        raise GenerationInputError(f"Unknown SpecBench categories {sorted(unknown)}",
                                   f"the file has {', '.join(available)}", "pick from those")
    picked = []
    for category in wanted:
        picked += [q for q in questions if q.category == category][:per_category]
    return picked
