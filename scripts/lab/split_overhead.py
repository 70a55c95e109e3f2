"""Per-token cost of the split target (prefix + suffix graphs) against one unsplit graph of the same model.

Both run on the same session settings, interleaved token by token, greedy on the split target's argmax. The unsplit
graph comes from one of two places:

    python scripts/lab/split_overhead.py EXPORT_DIR --merge SCRATCH_DIR [--tokens 128] [--threads 1]
        merges the folder's prefix.onnx and suffix.onnx into SCRATCH_DIR/unsplit.onnx (reused when there; weights
        in unsplit.onnx.data beside it). Works on any export, no re-export needed.

    python scripts/lab/split_overhead.py EXPORT_DIR [--tokens 128] [--threads 1]
        an export made with --draft-layers N (N = the target's depth), whose draft graph is the whole target.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.models import DraftModel, TargetModel
from unsplit_graph import open_unsplit


@dataclass(frozen=True)
class Comparison:
    split_ms: float  # median per token
    full_ms: float
    max_diff: float  # max |logit diff| over the prompt's rows and every decoded token
    same_argmax: int
    tokens: int


def compare(target: TargetModel, full: DraftModel, prompt: list[int], tokens: int) -> Comparison:
    """Prefill both, then decode ``tokens`` greedily (split target's choice), timing each step of each."""
    capacity = len(prompt) + tokens + 8
    target.reset(1, capacity)
    full.reset(capacity)
    a, b = target.extend(prompt), full.extend(prompt)
    split_ms, full_ms, max_diff, same = [], [], float(np.abs(a - b).max()), 0
    token = int(np.argmax(a[-1]))
    for _ in range(tokens):
        t0 = time.perf_counter()
        a = target.extend([token])[-1]
        t1 = time.perf_counter()
        b = full.extend([token])[-1]
        t2 = time.perf_counter()
        split_ms.append((t1 - t0) * 1e3)
        full_ms.append((t2 - t1) * 1e3)
        max_diff = max(max_diff, float(np.abs(a - b).max()))
        same += int(np.argmax(a) == np.argmax(b))
        token = int(np.argmax(a))
    return Comparison(statistics.median(split_ms), statistics.median(full_ms), max_diff, same, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--merge", metavar="SCRATCH_DIR",
                        help="merge prefix + suffix into SCRATCH_DIR/unsplit.onnx (outside the export folder)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every session")
    parser.add_argument("--prompt", default="Explain how a hash map works.")
    args = parser.parse_args()
    devices = DeviceRequest("cpu", "cpu", args.threads, args.threads)
    with Pipeline.load(args.folder, devices) as pipe:
        if args.merge:
            full, label = open_unsplit(pipe.folder, pipe.manifest, Path(args.merge), devices, args.threads), "merged"
        elif pipe.manifest.draft.num_layers == pipe.manifest.target.num_layers:
            full, label = pipe.draft, "draft = target"
        else:
            raise SystemExit("pass --merge SCRATCH_DIR, or export with --draft-layers N (N = target depth) so that "
                             "the draft is the unsplit target")
        r = compare(pipe.target, full, pipe.encode(args.prompt, GenerationConfig()), args.tokens)
    s, f = r.split_ms, r.full_ms
    print(f"| graphs | median ms/token | tok/s |\n|---|---|---|\n| prefix + suffix | {s:.2f} | {1e3 / s:.1f} |\n"
          f"| one graph ({label}) | {f:.2f} | {1e3 / f:.1f} |\n\nsplit overhead: {100 * (s / f - 1):+.1f} % per "
          f"token; max |logit diff| {r.max_diff:.2e}; same argmax {r.same_argmax}/{r.tokens}; threads {args.threads}")


if __name__ == "__main__":
    main()
