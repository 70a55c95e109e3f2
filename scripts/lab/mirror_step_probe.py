"""Where a Mirror-SD step's time goes: per prompt, the decode time per step, the target's and the draft's busy time
per step and the part of the draft's that overlapped the target's (GenerationStats), with and without the exit head.

    python scripts/lab/mirror_step_probe.py EXPORT [TARGET+DRAFT threads (2+2)] [PROMPTS (4)] [TOKENS (128)]

Compare the target's busy time per step with the profile's verify + exit alone: the ratio is the contention the
step really saw, which the latency model (runtime/planner/sharing.py) derives from the profile's contention factors
and the draft's idle stretches.
"""
from __future__ import annotations

import sys

from mirrorsd import specbench
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline


def main(export: str, split: str, prompts: int, tokens: int) -> None:
    target, draft = (int(n) for n in split.split("+"))
    questions = specbench.first_per_category(specbench.read(None), (), 1)[:prompts]
    with Pipeline.load(export, DeviceRequest(target_threads=target, draft_threads=draft)) as pipe:
        pipe.generate("Say hello.", GenerationConfig(mode="mirror", max_new_tokens=8))
        print("| exit head | category | steps | step ms | target busy ms/step | draft busy ms/step "
              "| overlapped ms/step | reuse | tokens/step | decode tok/s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for exit_head in (True, False):
            for q in questions:
                s = pipe.generate(q.text, GenerationConfig(mode="mirror", max_new_tokens=tokens,
                                                           exit_head=exit_head)).stats
                per = 1e3 / s.steps
                print(f"| {'on' if exit_head else 'off'} | {q.category} | {s.steps} | "
                      f"{(s.seconds - s.time_to_first_token_s) * per:.1f} | {s.target_busy_s * per:.1f} | "
                      f"{s.draft_busy_s * per:.1f} | {s.draft_hidden_s * per:.1f} | {s.reuse_rate:.2f} | "
                      f"{s.mean_accepted_tokens:.2f} | {s.decode_tokens_per_second:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "2+2", int(sys.argv[3]) if len(sys.argv) > 3 else 4,
         int(sys.argv[4]) if len(sys.argv) > 4 else 128)
