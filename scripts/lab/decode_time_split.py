"""Where a decoder's decode time goes, timed inside real generation: every graph call is recorded with its graph
role, its row count and its cached length, and each prompt's decode time (after the first token) is split into
target passes by rows, draft forwards by rows (the draft's prefill of the prompt apart), and the rest (host work).

    python scripts/lab/decode_time_split.py EXPORT MODES [TOKENS (128)] [PER_CATEGORY (1)] [PROMPT_FILE]
        MODES: comma-separated bench-like settings, e.g. ar,sd-stop-ngram (sd-stop: --draft-confidence 0.8;
        -ngram: n-gram proposer on; a suffix runs the mode on a pipeline of its own: +fused-draft, the draft keeps
        the fused attention and the copied cache (DeviceRequest.draft_kv_in_place=False); +all-rows, every row of
        a prompt's chunks and of a rollout's forwards scored (prompt_last_row_only=False); +no-prefetch, the
        kernel's tiles not prefetching (MIRRORSD_KERNELS_PREFETCH=0 while that pipeline loads))

Modes alternate prompt by prompt in one process, so their rows are comparable within the run. PROMPT_FILE: one
prompt, that file's text (chat template applied), instead of the SpecBench questions (a long context).
"""
from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from mirrorsd import specbench
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.models import PREFILL_CHUNK
from mirrorsd.runtime.session import GraphSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_setting_ab import environment  # noqa: E402  (the same settings, set while a pipeline loads)

PREFILL_ROWS = 16  # a draft call with more rows than this is its prefill of the prompt


VARIANTS = {"": {}, "+fused-draft": {"draft_kv_in_place": False}, "+all-rows": {"prompt_last_row_only": False},
            "+no-prefetch": {}}
SETTINGS = {"+no-prefetch": "MIRRORSD_KERNELS_PREFETCH=0"}  # kernel settings in force while the variant loads


def load(folder: str, variant: str) -> Pipeline:
    with environment(SETTINGS.get(variant, "default")):
        return Pipeline.load(folder, DeviceRequest(spin_in_run=True, **VARIANTS[variant]))


def variant_of(mode: str) -> str:
    return next((suffix for suffix in VARIANTS if suffix and mode.endswith(suffix)), "")


def config_of(mode: str, tokens: int) -> GenerationConfig:
    base = mode.removesuffix(variant_of(mode)).replace("-ngram", "").replace("-stop", "")
    return GenerationConfig(mode=base, max_new_tokens=tokens, draft_confidence=0.8 if "-stop" in mode else 0.0,
                            ngram="-ngram" in mode)


def main(folder: str, modes: list[str], tokens: int, per_category: int, prompt_file: str | None = None) -> None:
    if prompt_file:
        questions = [specbench.Question("file", "file", Path(prompt_file).read_text())]
    else:
        questions = specbench.first_per_category(specbench.read(None), (), per_category)
    calls: list[tuple[str, int, float, float]] = []  # (role, rows, start, end)
    original = GraphSession.run

    def timed(self, feeds):
        start = time.perf_counter()
        out = original(self, feeds)
        calls.append((self.spec.role, int(feeds[self.first_input].shape[1]), start, time.perf_counter()))
        return out

    GraphSession.run = timed
    totals = {m: collections.Counter() for m in modes}
    counts = {m: collections.Counter() for m in modes}
    pipes = {variant: load(folder, variant) for variant in sorted({variant_of(mode) for mode in modes})}
    try:
        for pipe in pipes.values():
            pipe.generate("Say hello.", GenerationConfig(mode="sd", max_new_tokens=8))
        for q in questions:
            for mode in modes:
                pipe = pipes[variant_of(mode)]
                calls.clear()
                start = time.perf_counter()
                result = pipe.generate(q.text, config_of(mode, tokens))
                end = time.perf_counter()
                # the first token comes from the target's prefill, read PREFILL_CHUNK rows a call: its last suffix
                # call is the first one with fewer rows (a prompt of whole chunks counts its first step as prefill;
                # the stats' time to first token starts after the prompt's encoding, not at these calls)
                first = next(e for role, rows, _, e in calls if role == "suffix" and rows < PREFILL_CHUNK)
                t, c = totals[mode], counts[mode]
                t["decode"] += end - first
                t["prefill"] += first - start
                t["tokens"] += result.stats.new_tokens - 1
                c["prompt tokens"] += result.stats.prompt_tokens
                for role, rows, s, e in calls:
                    if e <= first:
                        continue
                    if role == "draft":
                        key = "draft prefill" if rows > PREFILL_ROWS else f"draft {min(rows, 6)} rows"
                    else:
                        key = f"target {role}"
                    t[key] += e - s
                    c[key] += 1
    finally:
        for pipe in pipes.values():
            pipe.close()
    print(f"{folder}: {len(questions)} prompts x {tokens} tokens; seconds of decode time (after the first token)")
    for mode in modes:
        t, c = totals[mode], counts[mode]
        graphs = sum(v for k, v in t.items() if k not in ("decode", "tokens", "prefill"))
        print(f"\n{mode}: decode {t['decode']:.2f} s for {t['tokens']} tokens = {t['tokens'] / t['decode']:.2f} "
              f"tok/s; prompt tokens {c['prompt tokens']}; outside graph calls {t['decode'] - graphs:.2f} s "
              f"({(t['decode'] - graphs) / t['decode']:.1%})")
        print(f"  prompt (to the first token) {t['prefill']:.2f} s")
        for key in sorted(k for k in t if k not in ("decode", "tokens", "prefill")):
            print(f"  {key:<22} {t[key]:7.2f} s {t[key] / t['decode']:6.1%}  calls {c[key]:5d}  "
                  f"{t[key] / max(c[key], 1) * 1e3:7.2f} ms each")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 128,
         int(sys.argv[4]) if len(sys.argv) > 4 else 1, sys.argv[5] if len(sys.argv) > 5 else None)
