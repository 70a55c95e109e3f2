"""Minimal mirrorsd sample: load an export folder, generate once, print the text and the statistics.

    python samples/python/generate.py exports/smollm2 "Why is the sky blue?" --mode mirror --max-new-tokens 64
    python samples/python/generate.py exports/tiny --ids 1 17 42 --mode sd      # token ids, no chat template
"""
from __future__ import annotations

import argparse

from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.config import MODE_CHOICES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an export folder written by mirrorsd-export")
    parser.add_argument("prompt", nargs="?", default="Why is the sky blue?",
                        help="text, sent through the chat template")
    parser.add_argument("--ids", type=int, nargs="+", help="prompt token ids instead of text (no template)")
    parser.add_argument("--mode", choices=MODE_CHOICES, default=GenerationConfig.mode)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=GenerationConfig.gamma, help="draft window length (sd, mirror)")
    args = parser.parse_args()

    config = GenerationConfig(mode=args.mode, max_new_tokens=args.max_new_tokens, gamma=args.gamma)
    with Pipeline.load(args.folder) as pipe:
        result = pipe.generate(args.ids if args.ids else args.prompt, config)
    stats = result.stats
    print(result.text)
    print(f"tokens: {result.tokens}")
    print(f"mode {stats.mode}: {stats.new_tokens} tokens in {stats.seconds:.2f} s "
          f"({stats.tokens_per_second:.1f} tok/s), mean accepted tokens {stats.mean_accepted_tokens:.2f}, "
          f"acceptance {stats.acceptance_rate:.2f}, reuse {stats.reuse_rate:.2f}")


if __name__ == "__main__":
    main()
