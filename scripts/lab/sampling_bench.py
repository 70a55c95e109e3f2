"""Sampled decoding on an export folder: acceptance, reuse and speedup of sd / mirror under both verification rules.

    python scripts/lab/sampling_bench.py EXPORT_DIR [--prompts 4] [--tokens 40] [--temperatures 1.0,0.7]

Same prompts, same seeds, one run. With the exact rule every committed token is a target draw keyed by
(seed, position), so sd/mirror must reproduce ar's sampled tokens exactly; the script checks that.
"""
from __future__ import annotations

import argparse
import statistics

from mirrorsd import specbench
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    questions = specbench.first_per_category(specbench.read(), (), 1)[: args.prompts]
    configs = [("ar", "exact"), ("sd", "exact"), ("sd", "residual"), ("mirror", "exact"), ("mirror", "residual")]
    print("| T | mode | rule | tok/s | speedup | acceptance | mean accepted | reuse | same tokens as ar |")
    print("|---|---|---|---|---|---|---|---|---|")
    with Pipeline.load(args.folder, DeviceRequest()) as pipe:
        pipe.generate("Hi", GenerationConfig(mode="mirror", max_new_tokens=4))  # warm-up
        for temperature in (float(t) for t in args.temperatures.split(",")):
            rows = {c: [] for c in configs}
            for i, q in enumerate(questions):
                ar_tokens = None
                for mode, rule in configs:
                    out = pipe.generate(q.text, GenerationConfig(
                        mode=mode, verify=rule, max_new_tokens=args.tokens, do_sample=True,
                        temperature=temperature, top_k=0, top_p=1.0, seed=args.seed + i))
                    ar_tokens = out.tokens if mode == "ar" else ar_tokens
                    rows[(mode, rule)].append((out.stats, out.tokens == ar_tokens))
            base = statistics.mean(s.tokens_per_second for s, _ in rows[("ar", "exact")])
            for (mode, rule), results in rows.items():
                tps = statistics.mean(s.tokens_per_second for s, _ in results)
                same = sum(ok for _, ok in results)
                print(f"| {temperature} | {mode} | {rule if mode != 'ar' else '-'} | {tps:.2f} | {tps / base:.2f} | "
                      f"{statistics.mean(s.acceptance_rate for s, _ in results):.2f} | "
                      f"{statistics.mean(s.mean_accepted_tokens for s, _ in results):.2f} | "
                      f"{statistics.mean(s.reuse_rate for s, _ in results):.2f} | {same}/{len(results)} |", flush=True)


if __name__ == "__main__":
    main()
