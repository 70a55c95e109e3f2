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
    parser = argparse.ArgumentParser(prog="mirrorsd-train-draft", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_argument_group("models")
    models.add_argument("--draft", required=True, type=Path, help="the draft to fine-tune (HF folder or .gguf)")
    models.add_argument("--target", required=True, type=Path,
                        help="the target whose greedy answers are learned: a model (HF folder, .gguf, pinned name; "
                             "run by PyTorch) or a mirrorsd export folder (run by ONNX Runtime: faster on a CPU)")
    models.add_argument("--output", "-o", required=True, type=Path, help="folder for the streaming draft")
    streams = parser.add_argument_group("streams")
    streams.add_argument("--streams", type=int, default=2, metavar="N",
                         help="lookahead streams n: tokens per draft forward = 1 + n (default 2, the paper's)")
    streams.add_argument("--stream-layers", type=int, default=4, metavar="M",
                         help="top layers that carry the streams and are trained (default 4)")
    streams.add_argument("--method", choices=("lora", "top", "full"), default="lora",
                         help="lora: adapters on the stream layers (default); top: train those layers' weights; "
                              "full: train every weight (slow, memory x4)")
    streams.add_argument("--lora-rank", type=int, default=16)
    streams.add_argument("--lora-alpha", type=float, default=32.0)
    dat = parser.add_argument_group("data (the target's greedy answers, cached in OUTPUT)")
    dat.add_argument("--prompts", type=Path, help="SpecBench question.jsonl (default: the project's shared copy)")
    dat.add_argument("--train-prompts", type=int, default=64, help="training questions (0: all of them)")
    dat.add_argument("--eval-prompts", type=int, default=8, help="held-out questions scored before and after")
    dat.add_argument("--holdout", type=int, default=5,
                     help="the first N questions of every category are never trained on (mirrorsd bench uses 2)")
    dat.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    dat.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    dat.add_argument("--generation-batch", type=int, default=8, help="prompts per batched target generation")
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--epochs", type=float, default=3.0)
    opt.add_argument("--max-steps", type=int, help="optimizer steps (overrides --epochs)")
    opt.add_argument("--max-minutes", type=float,
                     help="stop after this many minutes of optimizer steps, then save and evaluate (the target's "
                          "answers and the frozen-layer pass come before and are not counted)")
    opt.add_argument("--lr", type=float, default=5e-4)
    opt.add_argument("--warmup-steps", type=int, default=10)
    opt.add_argument("--anchors", type=int, default=32, help="stream anchor positions per sample and step")
    opt.add_argument("--grad-accum", type=int, default=1, help="samples per optimizer step")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    run = parser.add_argument_group("run")
    run.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--resume", action="store_true", help="continue the training saved in OUTPUT")
    run.add_argument("--force", action="store_true", help="start over in a non-empty OUTPUT (cached answers kept)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _train(args))


def _train(args) -> int:
    from mirrorsd.export.streaming.train import TrainOptions, train

    options = TrainOptions(
        draft=args.draft, target=args.target, output=args.output, prompts=args.prompts, streams=args.streams,
        stream_layers=args.stream_layers, method=args.method, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        train_prompts=args.train_prompts or None, eval_prompts=args.eval_prompts, holdout=args.holdout,
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
        generation_batch=args.generation_batch, epochs=args.epochs, max_steps=args.max_steps,
        max_minutes=args.max_minutes, lr=args.lr, warmup_steps=args.warmup_steps, anchors=args.anchors,
        grad_accum=args.grad_accum, save_every=args.save_every, seed=args.seed, threads=args.threads,
        resume=args.resume, force=args.force, progress=not args.no_progress)
    result = train(options)
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
