"""What the early exit costs inside one Mirror-SD verification step: full exit head vs the sparse one.

    python scripts/lab/exit_cost.py EXPORT_DIR [--context 300] [--width 5] [--candidates 4] [--threads 2] [--repeats 9]

Prefills random ids to --context, then times (median of --repeats, the cache truncated back each time) the parts of
one target forward of --width rows: prefix, full exit head (exit_head.onnx: LM-head pass + top-k), sparse exit head
(exit_sparse.onnx, if the folder has one: --candidates ids per row), suffix. Prints ms and each exit's share of a
step (prefix + suffix + that exit).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mirrorsd import names
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.models import cache_feeds, logits_from_feed, single_row_inputs


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    request = DeviceRequest(target="cpu", draft="cpu", target_threads=args.threads, draft_threads=1)
    with Pipeline.load(args.folder, request) as pipe:
        target, vocab = pipe.target, pipe.manifest.target.vocab_size
        ids = rng.integers(100, min(vocab, 30000), size=args.context + args.width).tolist()
        target.reset(1, args.context + args.width + 8)
        target.extend(ids[:args.context])
        ids_w, mask, pos = single_row_inputs(ids[args.context:], args.context)
        feeds = {target.prefix.first_input: ids_w, names.ATTENTION_MASK: mask, names.POSITION_IDS: pos}
        feeds.update(cache_feeds(target.prefix_cache, args.width))
        hidden = target.prefix.run(feeds)[target.prefix.output_names[0]]
        suffix_feeds = {target.suffix.first_input: hidden, names.ATTENTION_MASK: mask, names.POSITION_IDS: pos}
        suffix_feeds.update(cache_feeds(target.suffix_cache, args.width))
        suffix_feeds.update(logits_from_feed(target.suffix, 0))
        parts = {"prefix": timed(lambda: target.prefix.run(feeds), args.repeats),
                 "suffix": timed(lambda: target.suffix.run(suffix_feeds), args.repeats),
                 "exit (full head)": timed(lambda: target.exit_head.run({target.exit_head.first_input: hidden}),
                                           args.repeats)}
        if target.exit_sparse is not None:
            draft_top = rng.integers(0, vocab, size=(args.width - 1, args.candidates))
            parts["exit (sparse head)"] = timed(lambda: target._exit_message(hidden, draft_top), args.repeats)
        step = parts["prefix"] + parts["suffix"]
        print(f"{args.folder}: context {args.context}, {args.width} rows, {args.threads} threads, "
              f"median of {args.repeats}")
        print("| part | ms | share of a step with it |")
        print("|---|---|---|")
        for name, ms in parts.items():
            share = f"{100 * ms / (step + ms):.1f} %" if name.startswith("exit") else ""
            print(f"| {name} | {ms:.2f} | {share} |")


if __name__ == "__main__":
    main()
