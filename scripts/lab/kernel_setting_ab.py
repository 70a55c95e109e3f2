"""Target forwards of W rows under two or more kernel settings, in one process, alternated: the verification terms of
the step-time model (W = 1 is a decoding step, W = gamma + 1 a window) for settings that mirrorsd's kernel reads when
a session creates its kernels (environment variables such as MIRRORSD_KERNELS_PREFETCH or MIRRORSD_KERNELS_ISA), or
for two builds of the library (LIBRARY=DIR, a folder of the kernel cache ~/.cache/mirrorsd/kernels/<hash>/: each
target's sessions register that build; ONNX Runtime keeps a custom-op library's domain per session).

    python scripts/lab/kernel_setting_ab.py EXPORT_DIR NAME=VALUE[@NAME=VALUE...],NAME=VALUE,... [--context 300]
                                            [--widths 1,2,5] [--repeats 31]

Opens the target once per setting (the variables set while it loads, then put back), prefills the same random ids
to --context in each, then times `extend(W)` + truncate for every W and setting in turn, --repeats times. Prints the
median ms per (setting, W), each W's cost in one-row steps of its setting, each setting's time against the first's
at that W, and whether every setting's logits of the last window were the same bits (they should: no setting of the
kernel may change a result). Compare within one run only: this VM's speed drifts between runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager

import numpy as np

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import Pipeline
from mirrorsd.runtime.models import PREFILL_CHUNK


@contextmanager
def environment(setting: str):
    """The variables of one setting ("A=1@B=2"; "default": none) set inside the block, put back after; LIBRARY=DIR
    makes the sessions opened inside register that build of the kernel library."""
    import dataclasses
    from pathlib import Path

    import mirrorsd.devices.kernels as kernels

    pairs = [] if setting == "default" else [part.partition("=")[::2] for part in setting.split("@")]
    build = dict(pairs).pop("LIBRARY", None)
    pairs = [(name, value) for name, value in pairs if name != "LIBRARY"]
    saved = {name: os.environ.get(name) for name, _ in pairs}
    os.environ.update(dict(pairs))
    default = kernels.library
    if build:
        kernels.library = lambda: dataclasses.replace(default(), path=Path(build) / "libmirrorsd_kern.so")
    try:
        yield
    finally:
        kernels.library = default
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("settings", help="comma-separated settings, each NAME=VALUE[@NAME=VALUE...] or default")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--widths", default="1,2,5")
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    settings = args.settings.split(",")
    widths = [int(w) for w in args.widths.split(",")]
    rng = np.random.default_rng(0)
    pipes, targets = [], []
    for setting in settings:
        with environment(setting):
            pipe = Pipeline.load(args.folder, DeviceRequest(spin_in_run=True))
        pipes.append(pipe)
        targets.append(pipe.target)
    info = pipes[0].manifest.target
    ids = rng.integers(100, min(info.vocab_size, 30000), size=args.context + max(widths)).tolist()
    for target in targets:
        target.reset(1, args.context + max(widths) + 8)
        while target.length < args.context:
            take = min(PREFILL_CHUNK, args.context - target.length)
            target.extend(ids[target.length: target.length + take])
    times = {(s, w): [] for s in range(len(settings)) for w in widths}
    last = {}
    for repeat in range(args.repeats + 1):  # the first round warms the shapes up and is dropped
        for w in widths:
            order = range(len(settings)) if repeat % 2 == 0 else reversed(range(len(settings)))
            for s in order:
                start = time.perf_counter()
                logits = targets[s].extend(ids[args.context: args.context + w])
                if repeat:
                    times[(s, w)].append(time.perf_counter() - start)
                last[(s, w)] = np.array(logits, copy=True)
                targets[s].truncate(args.context)
    ms = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    same = all(np.array_equal(last[(s, w)], last[(0, w)]) for s in range(len(settings)) for w in widths)
    print(f"context {args.context}, {args.repeats} alternated repeats, medians; logits the same bits in every "
          f"setting: {'yes' if same else 'NO'}")
    print(f"| setting | {' | '.join(f'W={w} ms' for w in widths)} | "
          f"{' | '.join(f'W={w}/W={widths[0]}' for w in widths[1:])} | "
          f"{' | '.join(f'W={w} vs first setting' for w in widths)} |")
    print("|---" * (3 * len(widths)) + "|")
    for s, setting in enumerate(settings):
        cells = [f"{ms[(s, w)]:.2f}" for w in widths]
        cells += [f"{ms[(s, w)] / ms[(s, widths[0])]:.2f}" for w in widths[1:]]
        cells += [f"{ms[(s, w)] / ms[(0, w)]:.3f}" for w in widths]
        print(f"| {setting} | {' | '.join(cells)} |")
    try:  # which builds of the library this process runs (one per LIBRARY setting)
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if line.rstrip().endswith("libmirrorsd_kern.so")})
        print(f"kernel libraries mapped: {', '.join(loaded) or 'none'}")
    except OSError:
        pass
    for pipe in pipes:
        pipe.close()


if __name__ == "__main__":
    main()
