"""``mirrorsd-train-draft``: a thin argparse shell over :func:`mirrorsd.export.streaming.train.train`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mirrorsd.cli_exit import run_command

DESCRIPTION = """\
Fine-tune a draft model for Speculative Streaming (arXiv 2402.11131): n learned stream embeddings enter its top
layers, so one draft forward both checks its previous lookahead and proposes n new tokens. The draft learns from
the target's own greedy answers to SpecBench prompts (the first --holdout questions of every category are held out
and scored before and after). Loss = next-token loss + 0.1 x each stream's loss on the token j+1 ahead.

The output folder is an ordinary Hugging Face draft (adapters merged) plus streaming.json and streams.safetensors;
mirrorsd-export --draft OUTPUT recognises it and adds draft_streaming.onnx to the export.

examples:
  mirrorsd-train-draft --draft ~/.cache/mirrorsd/hf/qwen2.5-coder-0.5b \\
      --target ~/.cache/mirrorsd/hf/qwen2.5-coder-1.5b --output drafts/qwen-0.5b-ss
  mirrorsd-train-draft ... --output drafts/qwen-0.5b-ss --resume          # continue after Ctrl-C
"""


def build_parser() -> argparse.ArgumentParser:
    from mirrorsd import flags
    from mirrorsd.export.streaming.options import METHODS, TrainOptions as T

    parser = argparse.ArgumentParser(prog="mirrorsd-train-draft", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_argument_group("models")
    flags.add(models, T, "draft", required=True, type=Path, help="the draft to fine-tune (HF folder or .gguf)")
    flags.add(models, T, "target", required=True, type=Path,
              help="the target whose greedy answers are learned: a model (HF folder, .gguf, pinned name; run by "
                   "PyTorch) or a mirrorsd export folder (run by ONNX Runtime: faster on a CPU)")
    flags.add(models, T, "output", "--output", "-o", required=True, type=Path, help="folder for the streaming draft")
    streams = parser.add_argument_group("streams")
    flags.add(streams, T, "streams", metavar="N",
              help="lookahead streams n: tokens per draft forward = 1 + n (default %(default)s, the paper's)")
    flags.add(streams, T, "stream_layers", metavar="M",
              help="top layers that carry the streams and are trained (default %(default)s)")
    flags.add(streams, T, "method", choices=METHODS,
              help="lora: adapters on the stream layers (default); top: train those layers' weights; "
                   "full: train every weight (slow, memory x4)")
    flags.add(streams, T, "lora_rank")
    flags.add(streams, T, "lora_alpha")
    dat = parser.add_argument_group("data (the target's greedy answers, cached in OUTPUT)")
    flags.add(dat, T, "prompts", type=Path,
              help="a SpecBench-shaped question.jsonl (default: $MIRRORSD_SPEC_BENCH, else the copy "
                   "shipped with mirrorsd)")
    flags.add(dat, T, "train_prompts", type=int, help="training questions (0: all of them)")
    flags.add(dat, T, "eval_prompts", help="held-out questions scored before and after")
    flags.add(dat, T, "holdout",
              help="the first N questions of every category are never trained on (default %(default)s, the rule of "
                   "mirrorsd.specbench; mirrorsd bench takes the first 2)")
    flags.add(dat, T, "max_prompt_tokens", help="skip longer prompts")
    flags.add(dat, T, "max_new_tokens", help="length of the target's answers")
    flags.add(dat, T, "generation_batch", help="prompts per batched target generation")
    opt = parser.add_argument_group("optimisation")
    flags.add(opt, T, "epochs")
    flags.add(opt, T, "max_steps", type=int, help="optimizer steps (overrides --epochs)")
    flags.add(opt, T, "max_minutes", type=float,
              help="stop after this many minutes of optimizer steps, then save and evaluate (the target's answers "
                   "and the frozen-layer pass come before and are not counted)")
    flags.add(opt, T, "lr")
    flags.add(opt, T, "warmup_steps")
    flags.add(opt, T, "anchors", help="stream anchor positions per sample and step")
    flags.add(opt, T, "grad_accum", help="samples per optimizer step")
    flags.add(opt, T, "seed")
    flags.add(opt, T, "threads", type=int, help="torch threads (default: torch's choice)")
    run = parser.add_argument_group("run")
    flags.add(run, T, "save_every", help="checkpoint every N steps (0: only at the end)")
    flags.add(run, T, "resume", help="continue the training saved in OUTPUT")
    flags.add(run, T, "force", help="start over in a non-empty OUTPUT (cached answers kept)")
    flags.add(run, T, "progress", "--no-progress", help="no progress bars")
    return parser


def train_options(args):
    """The TrainOptions that the flags ask for (--train-prompts 0: every training question)."""
    from mirrorsd import flags
    from mirrorsd.export.streaming.options import TrainOptions

    return flags.build(TrainOptions, args, train_prompts=args.train_prompts or None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _train(args))


def _train(args) -> int:
    from mirrorsd.export.streaming.train import train

    result = train(train_options(args))
    c = result.config
    print(f"streaming draft written to {result.folder}: {c.streams} streams on layers "
          f"{c.first_streamed_layer}..{c.num_layers - 1}, {c.method}, {result.steps} steps in {result.seconds:.0f} s "
          f"({c.training['seconds_per_step']} s/step, peak RSS {c.training['peak_rss_mb']:.0f} MB)")
    for when in ("before", "after"):
        m = c.evaluation[when]
        print(f"  held-out {when:6s}: tokens/forward {m['tokens_per_forward']:.2f}, "
              f"stream loss {m['stream_loss']:.3f}, "
              f"stream/main agreement {[round(a, 3) for a in m['stream_agrees_with_main']]}, "
              f"main top-1 {m['main_top1']:.3f}")
    print(f"next: mirrorsd-export --model {_target_model(c.target)} --draft {result.folder} --output EXPORT_FOLDER")
    return 0


def _target_model(target: str) -> str:
    """The model behind --target (an export folder names the model it was exported from)."""
    from mirrorsd.export.streaming.data import is_export_folder
    from mirrorsd.manifest import load_manifest

    return load_manifest(Path(target).expanduser()).target.source if is_export_folder(Path(target)) else target


if __name__ == "__main__":
    sys.exit(main())
