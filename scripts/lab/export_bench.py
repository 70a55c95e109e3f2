"""Peak memory and wall time of mirrorsd-export, measured from outside the exporting process.

    # how peak RSS and time scale with depth: random Qwen2-architecture models (hidden 2048, 36 layers = ~3B),
    # bf16 checkpoints built from a config (no download), exported with --precision int4 --draft-layers 4
    python scripts/lab/export_bench.py scaling --layers 9 18 36 --work /tmp/xb --curve /tmp/xb/curve.csv

    # one export, several exporter commands side by side (e.g. an older checkout), graphs compared with a reference
    python scripts/lab/export_bench.py pair --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --work /tmp/xb \
        --exporter new=".venv/bin/mirrorsd-export" --exporter old="python -m mirrorsd.export.cli" \
        --reference /work/exports/qwen

Peak RSS is the kernel's ru_maxrss of the exporter process (what /usr/bin/time -v reports); the memory curve
samples the RSS of the process tree every 0.25 s. Run it on a quiet machine: the numbers are the table it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2048, 11008, 16, 2, 151936  # Qwen2.5-3B's shape
TOKENIZER_FROM = Path.home() / ".cache" / "mirrorsd" / "hf" / "qwen2.5-coder-0.5b"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "chat_template.jinja")
SAMPLE_EVERY = 0.25  # seconds between RSS samples of the memory curve


def make_model(folder: Path, layers: int, seed: int = 0) -> Path:
    """A random-weight Qwen2 checkpoint in bf16 safetensors shards of 4 layers, written a shard at a time."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_FROM / name).is_file():
            shutil.copy2(TOKENIZER_FROM / name, tmp / name)
    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=151643, eos_token_id=151645, dtype="bfloat16")
    config.save_pretrained(tmp)
    with init_empty_weights():
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
                  if k != "lm_head.weight"}
    groups: dict[str, list[str]] = {}
    for name in shapes:  # one shard per 4 layers, embedding and final norm in the first
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        groups.setdefault(f"model-{layer // 4:05d}.safetensors", []).append(name)
    generator = torch.Generator().manual_seed(seed)
    for file, names in groups.items():
        tensors = {n: (torch.ones(shapes[n]) if n.endswith("norm.weight") else
                       torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16) for n in names}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, names in groups.items() for n in names}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    tmp.rename(folder)
    return folder


def measure(command: list[str], curve: list | None = None) -> tuple[float, int, int, str]:
    """(wall seconds, peak RSS bytes, exit code, output) of ``command``; appends (t, rss) samples to ``curve``."""
    import psutil

    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                parent = psutil.Process(proc.pid)
                rss = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
            except psutil.Error:
                rss = 0
            if curve is not None:
                curve.append((time.perf_counter() - started, rss))
            done.wait(SAMPLE_EVERY)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(output[-3000:], file=sys.stderr)
    return seconds, usage.ru_maxrss * 1024, proc.returncode, output


def phases(output: str, curve: list) -> list[tuple[float, float, str]]:
    """(start s, peak RSS GB, step) per step the exporter printed ("[  12.3s] writing prefix ..."), from the curve."""
    import re

    steps = [(float(m.group(1)), m.group(2)) for m in re.finditer(r"\[\s*([\d.]+)s\] (.+?) \.\.\.", output)]
    out = []
    for i, (start, step) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else float("inf")
        rss = [r for t, r in curve if start <= t < end]
        out.append((start, max(rss, default=0) / 1e9, step))
    return out


def scaling(args) -> None:
    rows, curves = [], {}
    for layers in args.layers:
        model = make_model(Path(args.work) / f"qwen2-random-{layers}L", layers)
        out = Path(args.work) / f"export-{layers}L"
        shutil.rmtree(out, ignore_errors=True)
        curve: list = []
        command = [*shlex.split(args.exporter), "--model", str(model), "--output", str(out),
                   "--precision", args.precision, "--draft-layers", str(args.draft_layers)]
        seconds, peak, code, output = measure(command, curve)
        weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        rows.append((layers, _params(layers) / 1e9, weights / 1e9, peak / 1e9, seconds, code))
        curves[layers] = curve
        steps = phases(output, curve)
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nmirrorsd-export --precision {args.precision} --draft-layers {args.draft_layers}, random Qwen2 "
          f"(hidden {HIDDEN}, vocab {VOCAB}), bf16 safetensors; CPU: {_cpu()}\n")
    print("| layers | parameters (B) | fp32 weights (GB) | checkpoint (GB) | peak RSS (GB) | wall (s) | exit |")
    print("|---|---|---|---|---|---|---|")
    for layers, params, weights, peak, seconds, code in rows:
        print(f"| {layers} | {params:.2f} | {params * 4:.1f} | {weights:.1f} | {peak:.2f} | {seconds:.0f} | {code} |")
    print(f"\nwhere the {rows[-1][0]}-layer export spends its time and memory (RSS sampled every {SAMPLE_EVERY} s):\n")
    print("| from (s) | step | peak RSS in the step (GB) |\n|---|---|---|")
    for start, peak, step in steps:
        print(f"| {start:.0f} | {step} | {peak:.2f} |")
    if len(rows) >= 2:
        (l0, *_, p0, s0, _), (l1, *_, p1, s1, _) = rows[0], rows[-1]
        print(f"\nper extra layer: {(p1 - p0) / (l1 - l0) * 1e3:.1f} MB of peak RSS, {(s1 - s0) / (l1 - l0):.2f} s")
    if args.curve:
        with open(args.curve, "w") as handle:
            handle.write("layers,seconds,rss_gb\n")
            for layers, curve in curves.items():
                handle.writelines(f"{layers},{t:.2f},{rss / 1e9:.3f}\n" for t, rss in curve)
        print(f"memory curve: {args.curve}")


def _params(layers: int) -> float:
    head_dim = HIDDEN // HEADS
    attention = HIDDEN * HIDDEN * 2 + HIDDEN * KV_HEADS * head_dim * 2 + HIDDEN + 2 * KV_HEADS * head_dim
    return layers * (attention + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN) + VOCAB * HIDDEN + HIDDEN


def pair(args) -> None:
    rows, comparisons, reference = [], {}, Path(args.reference) if args.reference else None
    for label, exporter in (e.split("=", 1) for e in args.exporter):
        out = Path(args.work) / f"pair-{label}"
        shutil.rmtree(out, ignore_errors=True)
        command = [*shlex.split(exporter), "--model", args.model, "--output", str(out)] + \
            (["--draft", args.draft] if args.draft else []) + shlex.split(args.extra)
        curve: list = []
        seconds, peak, code, output = measure(command, curve)
        rows.append((label, peak, seconds, code))
        print(f"\n{label}: peak RSS per step (sampled every {SAMPLE_EVERY} s)\n\n| from (s) | step | peak RSS (GB) |\n"
              "|---|---|---|")
        for start, step_peak, step in phases(output, curve):
            print(f"| {start:.0f} | {step} | {step_peak:.2f} |")
        if reference is None:  # no --reference: the first exporter's folder is the reference of the others
            reference = out
        elif code == 0:  # compared (after the timing) and removed: two exports need a lot of disk
            comparisons[label] = list(compare_folders(out, reference))
            shutil.rmtree(out, ignore_errors=True)
    print(f"\n`mirrorsd-export --model {args.model} --draft {args.draft} {args.extra}`; CPU: {_cpu()}\n")
    print("| exporter | peak RSS (GB) | wall (s) | exit |\n|---|---|---|---|")
    for label, peak, seconds, code in rows:
        print(f"| {label} | {peak / 1e9:.2f} | {seconds:.0f} | {code} |")
    if not args.reference and reference is not None:
        shutil.rmtree(reference, ignore_errors=True)
    for label, found in comparisons.items():
        print(f"\n{label} vs {args.reference or rows[0][0]} (every graph, whole batch and two chunks with KV):")
        for role, diff, same in found:
            print(f"  {role:16s} max |diff| {diff:.3g}  {'bitwise equal' if same else ''}")


def compare_folders(folder: Path, reference: Path):
    """(role, max |diff|, bitwise) for each graph, run on the validation batch from both folders in turn."""
    import numpy as np

    from mirrorsd import names
    from mirrorsd.export.validate import SPLIT_AT, FileRunner, Run, chunked, sample_batch
    from mirrorsd.manifest import load_manifest

    manifest = load_manifest(reference)
    ids, mask, pos = sample_batch(manifest.target.vocab_size)
    hidden = np.random.default_rng(0).standard_normal((*ids.shape, manifest.target.hidden_size)).astype(np.float32)
    for role, spec in manifest.graphs.items():
        first = ids if spec.inputs[0].name == names.INPUT_IDS else hidden
        runs = chunked(spec.inputs[0].name, (first, first[:, :SPLIT_AT], first[:, SPLIT_AT:]), mask, pos) \
            if spec.kv else [Run("full", {spec.inputs[0].name: first})]
        if spec.static_shapes:
            continue  # fixed shapes: covered by the export's own check
        outs = [FileRunner(f / spec.file, spec.kv).run(runs) for f in (folder, reference)]
        pairs = [(a, outs[1][run][name]) for run in outs[0] for name, a in outs[0][run].items()]
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in pairs)
        yield role, diff, all(np.array_equal(a, b) for a, b in pairs)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scaling", help="random Qwen2 models of several depths")
    s.add_argument("--layers", type=int, nargs="+", default=[9, 18, 36])
    s.add_argument("--precision", default="int4")
    s.add_argument("--draft-layers", type=int, default=4)
    s.add_argument("--work", required=True, help="folder for the models and exports (tens of GB)")
    s.add_argument("--exporter", default=f"{sys.executable} -m mirrorsd.export.cli")
    s.add_argument("--curve", help="write the memory curves (layers, seconds, RSS GB) to this CSV")
    p = sub.add_parser("pair", help="one export with several exporter commands, side by side")
    p.add_argument("--model", required=True)
    p.add_argument("--draft")
    p.add_argument("--extra", default="", help="more mirrorsd-export arguments, quoted")
    p.add_argument("--exporter", action="append", required=True, metavar="LABEL=COMMAND")
    p.add_argument("--work", required=True)
    p.add_argument("--reference", help="an export folder to compare every graph's outputs with "
                                       "(default: the first exporter's)")
    args = parser.parse_args(argv)
    scaling(args) if args.command == "scaling" else pair(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
