"""``mirrorsd-train-exit``: a thin argparse shell over :func:`mirrorsd.export.early_exit.train.train`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mirrorsd.cli_exit import run_command

DESCRIPTION = """\
Train the early exit of an export folder: a low-rank adapter before the target's LM head at the exit layer,
x -> x + (x @ down) @ up, fitted so that the exit's top-k predicts the target's *final* greedy token. The data are
the export target's own greedy answers to SpecBench prompts (the first --holdout questions of every category are
held out and scored before and after; mirrorsd bench uses those). Only the exit head changes: the target's prefix,
suffix and every output stay as they were.

Writes a new export folder: a copy of --model with the adapter inside exit_head.onnx, exit_sparse.onnx (the exit
head scoring only the candidate ids it is given: Mirror-SD passes the draft's top-k at each window position), and
the held-out hit rates in mirrorsd.json (exit_adapter).

example:
  mirrorsd-train-exit --model exports/qwen --output exports/qwen-exit
"""


def build_parser() -> argparse.ArgumentParser:
    from mirrorsd import flags
    from mirrorsd.export.early_exit.options import ExitTrainOptions as T

    parser = argparse.ArgumentParser(prog="mirrorsd-train-exit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    io = parser.add_argument_group("folders")
    flags.add(io, T, "model", required=True, type=Path, help="an export folder (mirrorsd-export); only read")
    flags.add(io, T, "output", "--output", "-o", required=True, type=Path,
              help="the new export folder (its exit_training/ keeps the target's answers for a re-run)")
    flags.add(io, T, "force", help="replace an export already in --output")
    dat = parser.add_argument_group("data")
    flags.add(dat, T, "prompts", type=Path,
              help="a SpecBench-shaped question.jsonl (default: $MIRRORSD_SPEC_BENCH, else the copy "
                   "shipped with mirrorsd)")
    flags.add(dat, T, "train_prompts", type=int, help="training questions (0: all of them)")
    flags.add(dat, T, "eval_prompts", help="held-out questions scored before and after")
    flags.add(dat, T, "holdout", help="the first N questions of every category are never trained on")
    flags.add(dat, T, "max_prompt_tokens", help="skip longer prompts")
    flags.add(dat, T, "max_new_tokens", help="length of the target's answers (one training row per token)")
    flags.add(dat, T, "generation_batch", help="prompts per batched target generation")
    flags.add(dat, T, "prompt_rows", help="also train on the target's tokens at the last N prompt positions")
    fit = parser.add_argument_group("adapter")
    flags.add(fit, T, "rank", help="rank r of the adapter (down [H, r], up [r, H])")
    flags.add(fit, T, "epochs")
    flags.add(fit, T, "batch", help="rows per optimizer step")
    flags.add(fit, T, "lr")
    flags.add(fit, T, "seed")
    flags.add(fit, T, "max_minutes", type=float, help="stop training after this many minutes")
    flags.add(fit, T, "sparse", "--no-sparse", help="do not write exit_sparse.onnx")
    flags.add(fit, T, "threads", type=int, help="threads for the target and torch (default: all cores)")
    flags.add(fit, T, "progress", "--no-progress", help="no progress lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _train(args))


def _train(args) -> int:
    from mirrorsd import flags
    from mirrorsd.export.early_exit.options import ExitTrainOptions
    from mirrorsd.export.early_exit.train import train

    options = flags.build(ExitTrainOptions, args, train_prompts=args.train_prompts or None)
    result = train(options, log=print if options.progress else (lambda text: None))
    info = result.info
    print(f"trained exit written to {result.folder}: rank {info.rank}, {info.train_rows} training rows, "
          f"{info.epochs} epochs in {info.seconds:.0f} s")
    for when, scores in (("untrained", info.untrained), ("trained", info.trained)):
        print(f"  held-out {when:9s} ({info.heldout_rows} rows): top-1 {scores['top1']:.3f}, "
              f"top-4 {scores['top4']:.3f}, top-8 {scores['top8']:.3f}, loss {scores['loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
