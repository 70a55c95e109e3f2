"""SpecBench questions, read in one place for the bench and for every trainer, and the hold-out rule they share.

    file      question.jsonl: one JSON object a line with question_id, category and turns; the first turn is the
              prompt (default: shared/data/spec_bench/question.jsonl beside the project, or $MIRRORSD_SPEC_BENCH)
    hold-out  the first HOLDOUT = 5 questions of every category, in file order, are held out: a trainer never trains
              on them (mirrorsd-train-draft scores the draft on them before and after), and ``mirrorsd bench``
              takes its prompts from the first --per-category (default 2) of every category. So with
              --per-category <= 5 a benchmark never runs a prompt that a draft was trained on.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import ExportOptionError, GenerationInputError

HOLDOUT = 5  # questions held out at the start of every category (see the module docstring)
# SpecBench's short-prompt categories. summarization and rag prompts run to ~800 tokens: their fp32 prefill alone
# costs about a minute per prompt and mode on 2 cores, so they are opt-in (--categories) on machines like this one.
DEFAULT_CATEGORIES = ("writing", "coding", "reasoning", "math_reasoning", "qa", "translation")
FIELDS = ("question_id", "category", "turns")


class QuestionFileError(GenerationInputError, ExportOptionError):
    """A SpecBench question file is missing, unreadable or malformed (the bench's --questions, a trainer's
    --prompts): a bad input to either, so it is both kinds of error."""


@dataclass(frozen=True)
class Question:
    question_id: int | str  # as in the file
    category: str
    text: str  # the first turn


def default_path() -> Path:
    env = os.environ.get("MIRRORSD_SPEC_BENCH")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" / "spec_bench" / "question.jsonl" for p in here.parents]
    for path in candidates:
        if path.is_file():
            return path
    raise QuestionFileError("SpecBench questions not found", "no question.jsonl beside the project",
                            "pass --questions PATH (bench) or --prompts PATH (trainer), or set MIRRORSD_SPEC_BENCH")


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
