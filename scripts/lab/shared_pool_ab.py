"""ar and sd-stop-ngram on sessions with pools of their own (2+2, spinning within a run, as the bench's fixed modes
run) and on the process's one shared pool (2 shared, as mode auto loads it where its profile predicts it faster),
alternated prompt by prompt in one process; decode tok/s, the ratio to 2+2's ar, and token parity with it.

    python scripts/lab/shared_pool_ab.py EXPORT [ROUNDS (1)]
"""
from __future__ import annotations

import statistics
import sys

from mirrorsd import specbench
from mirrorsd.apps.bench import variant
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline

MODES = ("ar", "sd-stop-ngram")


def main(export: str, rounds: int) -> None:
    questions = specbench.first_per_category(specbench.read(None), (), 1)
    pipes = {"2+2": Pipeline.load(export, DeviceRequest(target_threads=2, draft_threads=2, spin_in_run=True)),
             "2 shared": Pipeline.load(export, DeviceRequest(target_threads=2, draft_threads=2, shared_pool=True))}
    runs = [(split, mode) for split in pipes for mode in MODES]
    for split, mode in runs:  # warm-up
        pipes[split].generate("Say hello.", GenerationConfig(**{**variant(mode), "max_new_tokens": 8}))
    speed = {run: [] for run in runs}
    tokens_of = {}
    n = 0
    for _ in range(rounds):
        for question in questions:
            for split, mode in runs[n % len(runs):] + runs[:n % len(runs)]:
                result = pipes[split].generate(question.text,
                                               GenerationConfig(**{**variant(mode), "max_new_tokens": 128}))
                speed[(split, mode)].append(result.stats.decode_tokens_per_second)
                tokens_of[(split, mode, question.question_id)] = result.tokens
            n += 1
    ar = statistics.mean(speed[("2+2", "ar")])
    print("| pool | mode | decode tok/s | vs 2+2 ar | same tokens as 2+2 ar |\n|---|---|---:|---:|---|")
    for split, mode in runs:
        same = sum(tokens_of[(split, mode, q.question_id)] == tokens_of[("2+2", "ar", q.question_id)]
                   for q in questions)
        mean = statistics.mean(speed[(split, mode)])
        print(f"| {split} | {mode} | {mean:.2f} | {mean / ar:.3f} | {same}/{len(questions)} |")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
