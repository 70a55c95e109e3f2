"""Per-token cost of the split target (prefix + suffix graphs) against one unsplit graph of the same model.

An export made with ``--draft-layers N`` (N = the target's depth) has a draft graph that *is* the whole target in
one graph, so both run from one folder, on the same sessions settings, interleaved token by token:

    python scripts/split_overhead.py EXPORT_DIR [--tokens 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", default="Explain how a hash map works.")
    args = parser.parse_args()
    devices = DeviceRequest("cpu", "cpu", args.threads, args.threads)
    with Pipeline.load(args.folder, devices) as pipe:
        if pipe.manifest.draft.num_layers != pipe.manifest.target.num_layers:
            raise SystemExit("export with --draft-layers N (N = target depth) so that the draft is the unsplit target")
        ids = pipe.encode(args.prompt, __import__("mirrorsd.runtime", fromlist=["GenerationConfig"]).GenerationConfig())
        target, draft = pipe.target, pipe.draft
        target.reset(1, len(ids) + args.tokens + 8)
        draft.reset(len(ids) + args.tokens + 8)
        split_logits = target.extend(ids)[-1]
        full_logits = draft.extend(ids)[-1]
        split_ms, full_ms, max_diff, same = [], [], 0.0, 0
        token = int(np.argmax(split_logits))
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            a = target.extend([token])[-1]
            t1 = time.perf_counter()
            b = draft.extend([token])[-1]
            t2 = time.perf_counter()
            split_ms.append((t1 - t0) * 1e3)
            full_ms.append((t2 - t1) * 1e3)
            max_diff = max(max_diff, float(np.abs(a - b).max()))
            same += int(np.argmax(a) == np.argmax(b))
            token = int(np.argmax(a))
    s, f = statistics.median(split_ms), statistics.median(full_ms)
    print(f"| graphs | median ms/token | tok/s |\n|---|---|---|\n| prefix + suffix | {s:.2f} | {1e3 / s:.1f} |\n"
          f"| one graph | {f:.2f} | {1e3 / f:.1f} |\n\nsplit overhead: {100 * (s / f - 1):+.1f} % per token; "
          f"max |logit diff| {max_diff:.2e}; same argmax {same}/{args.tokens}; threads {args.threads}")


if __name__ == "__main__":
    main()
