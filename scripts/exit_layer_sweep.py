"""Hit rate of the early exit against the exit layer, untrained and trained, with each layer's prefix share.

    python scripts/exit_layer_sweep.py HF_FOLDER ANSWERS_DIR [--layers 7,10,14,18,21] [--train-rows 4000] [--eval-rows N]
                                      [--rank 64] [--epochs 4] [--threads 2] [--json OUT.json]
                                      [--profile PROFILE.json [--exit-layer L0]]

ANSWERS_DIR holds distill-train-T.jsonl and distill-eval-T.jsonl (T = --max-new-tokens) (the target's greedy answers, as mirrorsd-train-exit
caches them in OUTPUT/exit_training/). One PyTorch pass (fp32, output_hidden_states) per answer gives h(L) at every
layer; the rows are the answer positions, labelled with this model's own greedy token. For each layer L:
x = final_norm(h(L)), the untrained exit is x @ W (the LM head), the trained one fits the same adapter as
mirrorsd-train-exit (export/early_exit/adapter.py) on the training rows; both are scored on the held-out rows.
The prefix share is L / N (decoder layers are uniform; the embedding lookup is free and the LM head belongs to the
suffix). Suggested layer: the latency model's (runtime/planner/exit_layer.py) with --profile, a measured profile of the
export (`mirrorsd devices --profile --model EXPORT`; its prefix times and the exit layer it was measured at): Mirror-SD's
predicted tok/s at each layer from its trained top-4 hit rate, which trades a deeper exit's better hit rate against
the suffix time left to hide the draft's branches under. `mirrorsd plan --profile P --exit-hits OUT.json` prints the
same table later from the --json output. Needs the Qwen 1.5B in fp32 (~7 GB): run it under /work/bin/bigmem on the shared machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from mirrorsd.export.early_exit.adapter import FitOptions, fit, score
from mirrorsd.export.streaming.data import load_samples


def layer_rows(model, samples, layers: list[int], limit: int | None) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """{L: x rows [N, H]} and labels [N] over the answer positions of ``samples`` (at most ``limit`` rows)."""
    xs: dict[int, list[np.ndarray]] = {L: [] for L in layers}
    labels, total = [], 0
    norm = model.model.norm
    for sample in samples:
        tokens = torch.tensor([sample.prompt + sample.completion])
        p = len(sample.prompt)
        with torch.no_grad():
            out = model(input_ids=tokens, output_hidden_states=True)
            rows = slice(p - 1, tokens.shape[1] - 1)
            labels.append(out.logits[0, rows].argmax(-1).numpy())
            for L in layers:
                xs[L].append(norm(out.hidden_states[L][0, rows]).float().numpy())
        total += len(labels[-1])
        if limit is not None and total >= limit:
            break
    return {L: np.concatenate(v)[:limit] for L, v in xs.items()}, np.concatenate(labels)[:limit].astype(np.int64)


def suggestion(profile_file: Path | None, exit_layer: int | None, hits: dict[int, float], layers: int) -> str:
    """The latency model's table and best layer for the first thread split of ``profile_file`` with prefix times."""
    if profile_file is None:
        return "suggested exit layer: pass --profile (a measured profile of the export) for the latency model's choice"
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table, format_exit_table

    profile = profiles.load(profile_file)
    for costs, detail in zip(profile.splits, profile.detail or ({},) * len(profile.splits)):
        base = exit_layer or (detail or {}).get("exit_layer")
        if costs.prefix_s and base and profile.acceptance is not None:
            rows = exit_layer_table(costs, profile.acceptance, hits, base)
            return f"split {costs.split}, exit measured at layer {base}:\n" + format_exit_table(rows, layers=layers)
    return "suggested exit layer: the profile has no split with prefix times and acceptance (re-measure it)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("answers", type=Path)
    parser.add_argument("--layers", default="7,10,14,18,21")
    parser.add_argument("--train-rows", type=int, default=4000)
    parser.add_argument("--eval-rows", type=int, default=None)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="a measured profile: suggest the layer the latency model predicts "
                                                     "fastest")
    parser.add_argument("--exit-layer", type=int, help="the exit layer the profile was measured at (default: its detail)")
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    layers = [int(x) for x in args.layers.split(",")]
    weight = model.lm_head.weight.detach().T.contiguous()  # [H, V]
    bias = None if model.lm_head.bias is None else model.lm_head.bias.detach()
    train_x, train_y = layer_rows(model, load_samples(next(args.answers.glob("distill-train*.jsonl"))), layers, args.train_rows)
    eval_x, eval_y = layer_rows(model, load_samples(next(args.answers.glob("distill-eval*.jsonl"))), layers,
                                args.eval_rows)
    del model
    results = []
    print(f"{args.model}: {n} layers, {len(train_y)} training rows, {len(eval_y)} held-out rows, rank {args.rank}")
    print("| exit layer L | prefix share L/N | untrained top-1 | untrained top-4 | trained top-1 | trained top-4 |")
    print("|---|---|---|---|---|---|")
    for L in layers:
        before = score(None, eval_x[L], eval_y, weight, bias)
        after = fit(train_x[L], train_y, eval_x[L], eval_y, weight, bias,
                    FitOptions(rank=args.rank, epochs=args.epochs)).after
        results.append({"layer": L, "prefix_share": L / n, "untrained": before.hit, "trained": after.hit,
                        "untrained_loss": before.loss, "trained_loss": after.loss})
        print(f"| {L} | {L / n:.2f} | {before.hit[1]:.3f} | {before.hit[4]:.3f} | {after.hit[1]:.3f} | "
              f"{after.hit[4]:.3f} |", flush=True)
    print(suggestion(args.profile, args.exit_layer, {r["layer"]: r["trained"][4] for r in results}, n))
    if args.json:
        args.json.write_text(json.dumps({"layers": n, "rows": [len(train_y), len(eval_y)], "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
