"""``mirrorsd-exit-sweep``: the early exit's hit rate against the exit layer, untrained and trained, per layer.

    mirrorsd-exit-sweep HF_FOLDER ANSWERS_DIR [--layers 7,10,14,18,21] [--json SWEEP.json] [--profile PROFILE.json]

    answers   ANSWERS_DIR holds distill-train-*.jsonl and distill-eval-*.jsonl: the target's greedy answers, as
              mirrorsd-train-exit caches them in OUTPUT/exit_training/
    rows      one PyTorch pass (fp32, every hidden state) per answer; a row is an answer position, its label the
              model's own greedy token there; x(L) = final_norm(h(L))
    untrained the exit as shipped: x(L) @ LM head
    trained   the adapter of mirrorsd-train-exit (export/early_exit/adapter.py), fitted on the training rows
    scores    top-1 / top-4 hit rates of both on the held-out rows; prefix share L / N (decoder layers are uniform)
    suggest   with --profile (a measured profile of an export of this target, ``mirrorsd devices --profile``): the
              latency model's Mirror-SD table over the swept layers (runtime/planner/exit_layer.py), best first

``--json`` is what ``mirrorsd-export --exit-hits`` and ``mirrorsd plan --exit-hits`` read: the layer count, the row
counts, and per layer the hit rates and losses of both exits. Needs torch and the target in fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mirrorsd.errors import ExportOptionError

DEFAULT_LAYERS = (7, 10, 14, 18, 21)


@dataclass(frozen=True)
class SweepOptions:
    model: Path  # a Hugging Face folder of the target
    answers: Path  # a folder with distill-train-*.jsonl and distill-eval-*.jsonl
    layers: tuple[int, ...] = DEFAULT_LAYERS
    train_rows: int = 4000
    eval_rows: int | None = None  # None: every held-out row
    rank: int = 64
    epochs: int = 4
    threads: int = 2
    json: Path | None = None
    profile: Path | None = None
    exit_layer: int | None = None  # the layer the profile was measured at (default: its detail)


def answer_files(folder: Path) -> tuple[Path, Path]:
    """(training, held-out) answer files of ``folder``, or ExportOptionError saying what is missing."""
    found = []
    for kind in ("train", "eval"):
        files = sorted(Path(folder).glob(f"distill-{kind}*.jsonl"))
        if not files:
            raise ExportOptionError(f"No distill-{kind}*.jsonl in '{folder}'",
                                    "the sweep reads the target's greedy answers that mirrorsd-train-exit caches",
                                    "pass the exit_training/ folder of a mirrorsd-train-exit output")
        found.append(files[0])
    return found[0], found[1]


def layer_rows(model, samples, layers: tuple[int, ...], limit: int | None) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """{L: x rows [N, H]} and labels [N] over the answer positions of ``samples`` (at most ``limit`` rows)."""
    import torch

    xs: dict[int, list[np.ndarray]] = {L: [] for L in layers}
    labels, total = [], 0
    norm = model.model.norm
    for sample in samples:
        tokens = torch.tensor([sample.prompt + sample.completion])  # [1, P + C]
        p = len(sample.prompt)
        with torch.no_grad():
            out = model(input_ids=tokens, output_hidden_states=True)
            rows = slice(p - 1, tokens.shape[1] - 1)  # the positions that predict the answer's tokens
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


def sweep(options: SweepOptions, out=print) -> dict:
    """Score the untrained and the trained exit at every layer of ``options.layers``; returns the --json record."""
    import torch
    import transformers

    from mirrorsd.export.early_exit.adapter import FitOptions, fit, score
    from mirrorsd.export.streaming.data import load_samples

    train_file, eval_file = answer_files(options.answers)
    if not (Path(options.model) / "config.json").is_file():
        raise ExportOptionError(f"'{options.model}' is not a Hugging Face model folder", "it has no config.json",
                                "pass the target's HF folder (mirrorsd fetch NAME prints a pinned model's)")
    torch.set_num_threads(options.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(options.model, torch_dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    bad = [L for L in options.layers if not 1 <= L < n]
    if bad:
        raise ExportOptionError(f"Exit layers {bad} are out of range", f"the model has {n} decoder layers",
                                f"pass --layers between 1 and {n - 1}")
    weight = model.lm_head.weight.detach().T.contiguous()  # [H, V]
    bias = None if model.lm_head.bias is None else model.lm_head.bias.detach()
    train_x, train_y = layer_rows(model, load_samples(train_file), options.layers, options.train_rows)
    eval_x, eval_y = layer_rows(model, load_samples(eval_file), options.layers, options.eval_rows)
    del model
    results = []
    out(f"{options.model}: {n} layers, {len(train_y)} training rows, {len(eval_y)} held-out rows, rank {options.rank}")
    out("| exit layer L | prefix share L/N | untrained top-1 | untrained top-4 | trained top-1 | trained top-4 |")
    out("|---|---|---|---|---|---|")
    for L in options.layers:
        before = score(None, eval_x[L], eval_y, weight, bias)
        after = fit(train_x[L], train_y, eval_x[L], eval_y, weight, bias,
                    FitOptions(rank=options.rank, epochs=options.epochs)).after
        results.append({"layer": L, "prefix_share": L / n, "untrained": before.hit, "trained": after.hit,
                        "untrained_loss": before.loss, "trained_loss": after.loss})
        out(f"| {L} | {L / n:.2f} | {before.hit[1]:.3f} | {before.hit[4]:.3f} | {after.hit[1]:.3f} | "
            f"{after.hit[4]:.3f} |")
    out(suggestion(options.profile, options.exit_layer, {r["layer"]: r["trained"][4] for r in results}, n))
    record = {"layers": n, "rows": [len(train_y), len(eval_y)], "results": results}
    if options.json is not None:
        _write_atomically(options.json, json.dumps(record, indent=1))
    return record


def _write_atomically(path: Path, text: str) -> None:
    """``path`` appears whole or not at all (a temporary file beside it, then a rename)."""
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorsd-exit-sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="the target as a Hugging Face folder (fp32 weights are loaded)")
    parser.add_argument("answers", type=Path, help="folder with distill-train-*.jsonl and distill-eval-*.jsonl "
                                                   "(mirrorsd-train-exit's OUTPUT/exit_training/)")
    parser.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)), help="comma-separated exit layers")
    parser.add_argument("--train-rows", type=int, default=SweepOptions.train_rows, help="training rows at most")
    parser.add_argument("--eval-rows", type=int, help="held-out rows at most (default: all)")
    parser.add_argument("--rank", type=int, default=SweepOptions.rank, help="the adapter's rank")
    parser.add_argument("--epochs", type=int, default=SweepOptions.epochs, help="training epochs per layer")
    parser.add_argument("--threads", type=int, default=SweepOptions.threads, help="PyTorch threads")
    parser.add_argument("--json", type=Path, help="write the sweep here (what mirrorsd-export --exit-hits reads)")
    parser.add_argument("--profile", type=Path,
                        help="a measured profile of an export of this target: print the latency model's table")
    parser.add_argument("--exit-layer", type=int,
                        help="the exit layer the profile was measured at (default: the profile's detail)")
    return parser


def options_from(args: argparse.Namespace) -> SweepOptions:
    try:
        layers = tuple(int(x) for x in args.layers.split(",") if x.strip())
    except ValueError:
        raise ExportOptionError(f"--layers '{args.layers}' is not a list of integers", "it names exit layers",
                                "pass e.g. --layers 7,14,21") from None
    return SweepOptions(args.model, args.answers, layers, args.train_rows, args.eval_rows, args.rank, args.epochs,
                        args.threads, args.json, args.profile, args.exit_layer)


def main(argv: list[str] | None = None) -> int:
    from mirrorsd.cli_exit import run_command

    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from mirrorsd.cli_exit import write_stdout

    sweep(options_from(args), out=lambda text: write_stdout(text + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
