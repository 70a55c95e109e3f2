"""The options of ``mirrorsd-train-exit``, defined once (the CLI takes its defaults from here; no torch needed)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mirrorsd.specbench import HOLDOUT


@dataclass(frozen=True)
class ExitTrainOptions:
    model: Path  # an export folder (mirrorsd-export): read only
    output: Path  # the new export folder: a copy with the trained exit_head.onnx (and exit_sparse.onnx)
    prompts: Path | None = None  # SpecBench question.jsonl (default: specbench.default_path())
    train_prompts: int | None = 64  # None: every training question
    eval_prompts: int = 16  # held-out questions scored before and after
    holdout: int = HOLDOUT  # the first N questions of every category are never trained on (mirrorsd.specbench)
    max_prompt_tokens: int = 384
    max_new_tokens: int = 64  # length of the target's answers (each answer position is one training row)
    generation_batch: int = 8
    prompt_rows: int = 64  # training rows from the last N prompt positions too (free: the same target pass)
    rank: int = 64
    epochs: int = 6
    batch: int = 256
    lr: float = 2e-3
    seed: int = 0
    max_minutes: float | None = None
    sparse: bool = True  # also write exit_sparse.onnx (the head that scores candidate ids only)
    threads: int | None = None
    force: bool = False
    progress: bool = True


def limits() -> dict:
    """The range of every numeric option (mirrorsd/ranges.py), checked before anything is read or loaded."""
    from mirrorsd.ranges import SEED, Range, threads

    return {"train_prompts": Range(1), "eval_prompts": Range(1), "holdout": Range(1),
            "max_prompt_tokens": Range(1, 2**20), "max_new_tokens": Range(1, 2**20),
            "generation_batch": Range(1, 1024), "prompt_rows": Range(0, 2**20), "rank": Range(1, 2**16),
            "epochs": Range(1, 10**6), "batch": Range(1, 2**24), "lr": Range(0, 10, above=True), "seed": SEED,
            "max_minutes": Range(0, 10**7, above=True), "threads": threads()}
