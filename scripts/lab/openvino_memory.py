"""Memory and speed of the draft on OpenVINO's CPU plugin against ONNX Runtime, over a long generation.

    python scripts/lab/openvino_memory.py [--tokens 4000] [--mode mirror] [--variants ort,ov-default,ov-cache0,...]

Builds (once, in --work) the tiny 2-layer model of tests/test_long_run.py with 10,240 positions, exported with
itself as the draft and no EOS, then runs one generation per variant, each in a fresh process, and prints a table:
process RSS when 1k, 2k, ... tokens are out, the growth after the first 1k, and tokens per second.

Variants (the target always runs on ONNX Runtime's CPU provider):
    ort              the draft on ONNX Runtime (the reference)
    ov-default       the draft on openvino:CPU with OpenVINO's own CPU_RUNTIME_CACHE_CAPACITY (5000 shapes)
    ov-cacheN        the same with CPU_RUNTIME_CACHE_CAPACITY=N (ov-cache0: no per-shape kernel cache)
    ov               the draft on openvino:CPU exactly as mirrorsd configures it
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is scripts/lab/openvino_memory.py)
PROMPT = [1, 17, 42, 99, 7]


def build(work: Path) -> Path:
    folder = work / "export"
    if (folder / "mirrorsd.json").is_file():
        return folder
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model

    from mirrorsd.export.pipeline import ExportOptions, export

    model = build_model(work / "hf", "llama", layers=2, max_positions=10_240)
    export(ExportOptions(model=model, output=folder, draft_layers=2))
    manifest = folder / "mirrorsd.json"
    data = json.loads(manifest.read_text())
    data["tokenizer"]["eos_token_ids"] = []  # nothing stops the run early
    manifest.write_text(json.dumps(data))
    return folder


def one_run(folder: Path, variant: str, tokens: int, mode: str) -> dict:
    """In this process: load the pipeline for ``variant``, generate ``tokens``, return RSS marks and speed."""
    import psutil

    from mirrorsd.devices import backends
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    if variant.startswith("ov-"):
        settings = variant[3:].split("-")
        base, compile_ = backends.OpenVINOSession.config, backends.OpenVINOSession._compile

        def config(self):
            out = {k: v for k, v in base(self).items() if k != "CPU_RUNTIME_CACHE_CAPACITY"}
            for setting in settings:
                if setting.startswith("cache"):
                    out["CPU_RUNTIME_CACHE_CAPACITY"] = setting[5:]
            return out

        def bounded_compile(self, model):  # every dynamic axis given an upper bound (the context, 10,240)
            import openvino as ov

            model.reshape({p.get_any_name(): ov.PartialShape([d if d.is_static else ov.Dimension(0, 10_240)
                                                               for d in p.get_partial_shape()]) for p in model.inputs})
            return compile_(self, model)

        backends.OpenVINOSession.config = config
        if "bounded" in settings:
            backends.OpenVINOSession._compile = bounded_compile
    draft = "cpu" if variant == "ort" else "openvino:CPU"
    process, marks, started = psutil.Process(), {}, time.perf_counter()
    with Pipeline.load(folder, DeviceRequest(target="cpu", draft=draft, target_threads=1, draft_threads=1)) as pipe:
        loaded = process.memory_info().rss

        def on_text(piece: str) -> None:
            n = pipe.target.length + 1 - len(PROMPT)
            mark = n // 1000 * 1000
            if mark and mark not in marks:
                marks[mark] = process.memory_info().rss

        out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=tokens, branches=2), on_text=on_text)
    return {"variant": variant, "loaded": loaded, "marks": marks, "tokens": len(out.tokens),
            "tok_s": out.stats.tokens_per_second, "wall": time.perf_counter() - started,
            "effective": pipe.placements["draft"].describe()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--mode", default="mirror", choices=("sd", "mirror"))
    parser.add_argument("--variants", default="ort,ov-default,ov-cache0,ov-cache64,ov")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mirrorsd-openvino-memory"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args()
    folder = build(args.work)
    if args.one:
        print(json.dumps(one_run(folder, args.one, args.tokens, args.mode)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        done = subprocess.run([sys.executable, __file__, "--one", variant, "--tokens", str(args.tokens), "--mode",
                               args.mode, "--work", str(args.work)], capture_output=True, text=True)
        if done.returncode:
            print(f"{variant}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{variant} done", file=sys.stderr, flush=True)
    marks = sorted({m for r in rows for m in map(int, r["marks"])})
    print(f"{args.mode}, {args.tokens} tokens, target on ONNX Runtime CPU, 1 thread per model; RSS in MiB")
    print("| variant | after load | " + " | ".join(f"{m // 1000}k" for m in marks) + " | growth 1k->last | tok/s |")
    print("|---|---|" + "---|" * len(marks) + "---|---|")
    for r in rows:
        rss = {int(k): v / 2**20 for k, v in r["marks"].items()}
        growth = rss[max(rss)] - rss[min(rss)] if rss else float("nan")
        print(f"| {r['variant']} | {r['loaded'] / 2**20:.0f} | " + " | ".join(
            f"{rss[m]:.0f}" if m in rss else "-" for m in marks) + f" | {growth:+.0f} | {r['tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
