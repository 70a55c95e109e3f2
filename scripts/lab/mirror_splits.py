"""Mode mirror at several thread splits beside ar, in one process: one pipeline per split, the splits and modes
alternated prompt by prompt on the held-out SpecBench prompts (one per category). Prints each (split, mode)'s mean
decode tokens/s, its ratio to ar (ar runs with all cores, as `mirrorsd generate` opens it) and whether its tokens
equal ar's.

    python scripts/lab/mirror_splits.py EXPORT [SPLITS (default 2+2,1+1)] [MODES (default mirror,mirror-noexit)]
                                        [TOKENS (128)]
"""
from __future__ import annotations

import statistics
import sys

from mirrorsd import specbench
from mirrorsd.apps.bench import variant
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline


def main(export: str, splits: list[str], modes: list[str], tokens: int) -> None:
    questions = specbench.first_per_category(specbench.read(None), (), 1)
    pipes = {"ar": Pipeline.load(export, DeviceRequest(spin_in_run=True))}
    for split in splits:
        target, draft = (int(n) for n in split.split("+"))
        pipes[split] = Pipeline.load(export, DeviceRequest(target_threads=target, draft_threads=draft))
    runs = [("ar", "ar")] + [(split, mode) for split in splits for mode in modes]
    for key, mode in runs:  # warm-up
        pipes[key].generate("Say hello.", GenerationConfig(**{**variant(mode), "max_new_tokens": 8}))
    speed = {run: [] for run in runs}
    tokens_of = {}
    for i, question in enumerate(questions):
        for key, mode in runs[i % len(runs):] + runs[:i % len(runs)]:
            result = pipes[key].generate(question.text, GenerationConfig(**{**variant(mode), "max_new_tokens": tokens}))
            speed[(key, mode)].append(result.stats.decode_tokens_per_second)
            tokens_of[(key, mode, question.question_id)] = result.tokens
    ar = statistics.mean(speed[("ar", "ar")])
    print("| split | mode | decode tok/s | vs ar | same tokens as ar |\n|---|---|---:|---:|---|")
    for key, mode in runs:
        same = sum(tokens_of[(key, mode, q.question_id)] == tokens_of[("ar", "ar", q.question_id)] for q in questions)
        mean = statistics.mean(speed[(key, mode)])
        print(f"| {key} | {mode} | {mean:.2f} | {mean / ar:.2f} | {same}/{len(questions)} |")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ["2+2", "1+1"],
         sys.argv[3].split(",") if len(sys.argv) > 3 else ["mirror", "mirror-noexit"],
         int(sys.argv[4]) if len(sys.argv) > 4 else 128)
