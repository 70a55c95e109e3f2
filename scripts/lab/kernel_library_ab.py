"""Two or more builds of mirrorsd's kernel library end to end: one process per (build, round), alternated, each
decoding the held-out SpecBench prompts (one per category) with MODES. Prints each run's mean decode tokens/s per
mode and a digest of its token ids (equal digests: the same tokens).

    python scripts/lab/kernel_library_ab.py EXPORT DIR1,DIR2[,...] [MODES (default ar,sd-stop-ngram)] [TOKENS (128)]
                                            [ROUNDS (2)]

A DIR is a build in the kernel cache (~/.cache/mirrorsd/kernels/<hash>/, which `mirrorsd.devices.kernels.library()`
fills for the sources checked out when it runs): build the variants first by checking each out and calling it.
DIR@NAME=VALUE[@NAME=VALUE...] runs that build with those environment variables set (one build, two settings:
e.g. DIR@MIRRORSD_KERNELS_SUPERBLOCKS=0,DIR@MIRRORSD_KERNELS_SUPERBLOCKS=1).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def one_run(export: str, build: str, modes: list[str], tokens: int) -> dict:
    import mirrorsd.devices.kernels as kernels

    chosen = Path(build) / "libmirrorsd_kern.so"
    default = kernels.library
    kernels.library = lambda: dataclasses.replace(default(), path=chosen)  # every session registers this build
    from mirrorsd import specbench
    from mirrorsd.apps.bench import variant
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    questions = specbench.first_per_category(specbench.read(None), (), 1)
    pipe = Pipeline.load(export, DeviceRequest(spin_in_run=True))
    for mode in modes:  # warm-up
        pipe.generate("Say hello.", GenerationConfig(**{**variant(mode), "max_new_tokens": 8}))
    out = {}
    for mode in modes:
        speeds, digest = [], hashlib.sha256()
        for question in questions:
            result = pipe.generate(question.text, GenerationConfig(**{**variant(mode), "max_new_tokens": tokens}))
            speeds.append(result.stats.decode_tokens_per_second)
            digest.update(json.dumps(result.tokens).encode())
        out[mode] = (statistics.mean(speeds), digest.hexdigest()[:12])
    pipe.close()
    return out


def main(export: str, builds: list[str], modes: list[str], tokens: int, rounds: int) -> None:
    print(f"| round | build | {' | '.join(modes)} |")
    print(f"|---|---|{'---|' * len(modes)}")
    for r in range(rounds):
        for spec in builds:
            build, *settings = spec.split("@")
            env = dict(os.environ)
            for setting in settings:
                name, _, value = setting.partition("=")
                env[name] = value
            line = subprocess.run([sys.executable, __file__, "--one", export, build, ",".join(modes), str(tokens)],
                                  check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
            result = json.loads(line)
            cells = " | ".join(f"{result[m][0]:.2f} ({result[m][1]})" for m in modes)
            label = " ".join([Path(build).name, *settings])
            print(f"| {r + 1} | {label} | {cells} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2], sys.argv[3], sys.argv[4].split(","), int(sys.argv[5]))))
    else:
        main(sys.argv[1], sys.argv[2].split(","),
             sys.argv[3].split(",") if len(sys.argv) > 3 else ["ar", "sd-stop-ngram"],
             int(sys.argv[4]) if len(sys.argv) > 4 else 128, int(sys.argv[5]) if len(sys.argv) > 5 else 2)
