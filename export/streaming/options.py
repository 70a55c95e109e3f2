"""The options of ``mirrorsd-train-draft``, defined once: the CLI takes its flags' defaults from here (no torch
needed)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mirrorsd.specbench import HOLDOUT

METHODS = ("lora", "top", "full")  # what trains: adapters on the stream layers | those layers | every weight


@dataclass(frozen=True)
class TrainOptions:
    draft: Path
    target: Path
    output: Path
    prompts: Path | None = None  # SpecBench question.jsonl (default: specbench.default_path())
    streams: int = 2  # n_s (docs/algorithm.md, Streaming drafts): a g-token window takes >= 1 + ceil((g-1)/(n+1))
    #                   forwards
    stream_layers: int = 4
    method: str = "lora"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    train_prompts: int | None = 64  # None: every training question
    eval_prompts: int = 8
    holdout: int = HOLDOUT  # the first N questions of every category are held out (mirrorsd.specbench)
    max_prompt_tokens: int = 384
    max_new_tokens: int = 128
    generation_batch: int = 8
    epochs: float = 3.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    max_minutes: float | None = None  # stop (and save) after this much optimizer-step time (data not counted)
    lr: float = 5e-4
    warmup_steps: int = 10
    anchors: int = 32  # stream anchor positions per sample and step (each carries all n streams)
    grad_accum: int = 1
    save_every: int = 25
    seed: int = 0
    threads: int | None = None
    resume: bool = False
    force: bool = False
    progress: bool = True


def limits() -> dict:
    """The range of every numeric option (mirrorsd/ranges.py), checked before anything is read or loaded."""
    from mirrorsd.ranges import SEED, Range, threads

    return {"streams": Range(1, 64), "stream_layers": Range(1, 2**16), "lora_rank": Range(1, 2**16),
            "lora_alpha": Range(0, 10**6, above=True), "train_prompts": Range(1), "eval_prompts": Range(1),
            "holdout": Range(1), "max_prompt_tokens": Range(1, 2**20), "max_new_tokens": Range(2, 2**20),
            "generation_batch": Range(1, 1024), "epochs": Range(0, 10**6, above=True), "max_steps": Range(1),
            "max_minutes": Range(0, 10**7, above=True), "lr": Range(0, 10, above=True),
            "warmup_steps": Range(0), "anchors": Range(1, 2**16), "grad_accum": Range(1, 2**20),
            "save_every": Range(0), "seed": SEED, "threads": threads()}
