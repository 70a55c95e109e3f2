"""A chat loop on an export folder: streams each answer as it is decoded and keeps the conversation.

    python samples/python/chat.py exports/smollm2 --mode mirror --system "You are concise."

The history is kept as messages and re-rendered through the model's chat template every turn (the template decides
how turns are joined); the whole conversation is then re-encoded and generated from. Type /reset to start over,
/quit or Ctrl-D to leave.
"""
from __future__ import annotations

import argparse
import sys

from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.config import MODE_CHOICES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an export folder written by mirrorsd-export")
    parser.add_argument("--mode", choices=MODE_CHOICES, default=GenerationConfig.mode)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--system", help="an optional system message")
    parser.add_argument("--stats", action="store_true", help="print tok/s and acceptance after each answer")
    args = parser.parse_args()

    config = GenerationConfig(mode=args.mode, max_new_tokens=args.max_new_tokens)
    with Pipeline.load(args.folder) as pipe:
        history = [{"role": "system", "content": args.system}] if args.system else []
        start = len(history)
        while True:
            try:
                user = input("you> ").strip()
            except EOFError:
                print()
                return
            if user in ("/quit", "/exit"):
                return
            if user == "/reset":
                del history[start:]
                continue
            if not user:
                continue
            history.append({"role": "user", "content": user})
            rendered = pipe.codec.render_chat(history)  # the template adds the assistant's turn header
            ids = pipe.codec.tokenizer.encode(rendered, add_special_tokens=False).ids
            print("bot> ", end="", flush=True)
            result = pipe.generate(ids, config, on_text=lambda piece: print(piece, end="", flush=True))
            print()
            history.append({"role": "assistant", "content": result.text})
            if args.stats:
                s = result.stats
                print(f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
                      f"mean accepted {s.mean_accepted_tokens:.2f}]", file=sys.stderr)


if __name__ == "__main__":
    main()
