"""Decode speed of several exports side by side: one process, the exports (and modes) alternated prompt by prompt on
the held-out SpecBench prompts, so drift in machine speed hits every export alike. Prints each one's mean decode
tokens/s and whether its tokens equal its own ar's. ONNX Runtime pools spin within a run as `mirrorsd generate`'s do
(runtime/config.spins_in_run), unless a mode in MODES is one that runs two sessions at once (mirror).

    python scripts/lab/exports_ab.py EXPORT1,EXPORT2,... [MODES (default ar; bench mode names,
                                                      e.g. sd-stop)] [TOKENS (default 128)]
"""
from __future__ import annotations

import statistics
import sys
from collections import Counter

from mirrorsd import specbench
from mirrorsd.apps.bench import variant
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.config import spins_in_run

COUNTED = ("new_tokens", "steps", "drafted", "draft_forwards")  # GenerationStats fields summed over the prompts


def main(folders: list[str], modes: list[str], tokens: int) -> None:
    questions = specbench.first_per_category(specbench.read(None), (), 1)
    request = DeviceRequest(spin_in_run=all(spins_in_run(variant(m)["mode"]) for m in modes))
    pipes = {f: Pipeline.load(f, request) for f in folders}
    for pipe in pipes.values():  # warm-up
        for mode in modes:
            pipe.generate("Say hello.", GenerationConfig(**{**variant(mode), "max_new_tokens": 8}))
    speed = {(f, m): [] for f in folders for m in modes}
    counts = {(f, m): Counter() for f in folders for m in modes}
    out = {}
    for i, question in enumerate(questions):
        order = [(f, m) for f in folders for m in modes]
        order = order[i % len(order):] + order[:i % len(order)]
        for folder, mode in order:
            config = GenerationConfig(**{**variant(mode), "max_new_tokens": tokens})
            result = pipes[folder].generate(question.text, config)
            speed[(folder, mode)].append(result.stats.decode_tokens_per_second)
            counts[(folder, mode)].update({k: getattr(result.stats, k) for k in COUNTED})
            out[(folder, mode, question.question_id)] = result.tokens
    for (folder, mode), values in speed.items():
        same = sum(out[(folder, mode, q.question_id)] == out[(folder, "ar", q.question_id)] for q in questions) \
            if "ar" in modes else "-"
        count = counts[(folder, mode)]
        print(f"{folder:40s} {mode:6s} decode tok/s mean {statistics.mean(values):6.2f}  "
              f"per prompt {[round(v, 1) for v in values]}  same-as-ar {same}  tokens/step "
              f"{count['new_tokens'] / max(1, count['steps']):.2f}  drafted {count['drafted']}  "
              f"draft forwards {count['draft_forwards']}")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2].split(",") if len(sys.argv) > 2 else ["ar"],
         int(sys.argv[3]) if len(sys.argv) > 3 else 128)
