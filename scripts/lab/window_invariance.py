"""Does a row's target output depend on the rows verified beside it? (docs/algorithm.md, Batch invariance)

    python scripts/lab/window_invariance.py EXPORT_DIR [--window 5] [--steps 20] [--target-device openvino:CPU]

Decodes a prompt greedily; at each step feeds the next `window` ar tokens as one verification window and again one
token at a time, and prints the max |logit diff| and how often the argmax differs. 0.0 = bitwise identical.
"""
from __future__ import annotations

import argparse

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt", default="Write a Python function that merges two sorted lists.")
    parser.add_argument("--target-device", default="auto", help="where the target runs (see `mirrorsd devices`)")
    parser.add_argument("--kernels", choices=("auto", "mirrorsd", "ort"), default="auto",
                        help="whose MatMulNBits kernel ONNX Runtime CPU sessions run (as for generate)")
    args = parser.parse_args()
    with Pipeline.load(args.folder, DeviceRequest(target=args.target_device, draft="cpu", kernels=args.kernels)) as pipe:
        prompt = pipe.encode(args.prompt, GenerationConfig())
        tokens = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=args.steps + args.window)).tokens
        target, worst, flips, rows = pipe.target, 0.0, 0, 0
        target.reset(1, len(prompt) + len(tokens) + 8)
        target.extend(prompt)
        for step in range(args.steps):
            window = tokens[step: step + args.window]
            base = target.length
            together = target.extend(window)
            target.truncate(base)
            alone = np.stack([target.extend([t])[-1] for t in window])
            target.truncate(base)
            target.extend([tokens[step]])
            worst = max(worst, float(np.abs(together - alone).max()))
            flips += int((together.argmax(-1) != alone.argmax(-1)).sum())
            rows += len(window)
    print(f"target on {pipe.placements['suffix'].describe()}")
    print(f"window {args.window}: max |logit diff| {worst:.3e}; argmax differs on {flips}/{rows} rows")


if __name__ == "__main__":
    main()
