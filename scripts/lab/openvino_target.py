"""The target on OpenVINO's CPU plugin, setting by setting, against ONNX Runtime and OpenVINO GenAI, in one run.

    python scripts/lab/openvino_target.py EXPORT_DIR [--prompts 3] [--tokens 64] [--threads 2] [--variants a,b]
                                      [--genai] [--output report.json]

For each variant of the target's graphs (prefix + suffix, f32 inference precision hint):
  step costs      one forward of 1 row and of a gamma + 1 = 5 row window, median over the decode (ms)
  invariance      each window's logits against the same tokens decoded one row at a time (max |diff|, argmax
                  flips), the check of scripts/lab/window_invariance.py; 0.0 = bitwise
  decode          target-only greedy decoding of the SpecBench prompts: decode tok/s (after the first token)
  sd parity       for the settings that the runtime allows (OpenVINOTuning.inexact() == ""): sd's tokens against
                  ar's, and sd's tok/s (draft on ONNX Runtime CPU)
  graph           what the plugin compiled: fused attention nodes, state, dynamic quantization group, KV precision
--genai adds OpenVINO GenAI's LLMPipeline on the same prompt ids (the optimum-intel int4 IR of the export's source,
as `mirrorsd bench --modes ov-ar` converts it) with the same f32 hint and threads, and what its compiled model uses.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mirrorsd import names
from mirrorsd.devices.backends import BACKENDS, OpenVINOTuning, SessionSettings
from mirrorsd.devices.placement import DeviceRequest, Placement, kv_pairs
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig, Pipeline
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.models import TargetModel
from mirrorsd.runtime.proposers import TargetOnly
from mirrorsd.runtime.session import GraphSession, Timeline, graph_path

WINDOW = 5  # gamma + 1 rows, gamma = 4
VARIANTS = {  # name -> OpenVINOTuning, or None for ONNX Runtime CPU
    "ort": None,
    "ov-as-exported": OpenVINOTuning(attention="as-exported"),  # what OpenVINOSession compiled before these rewrites
    "ov-dq-off": OpenVINOTuning(attention="as-exported", dynamic_quantization_group_size=0),
    "ov-exact-softmax": OpenVINOTuning(attention="exact-softmax"),
    "ov-fused": OpenVINOTuning(attention="fused"),
    "ov-stateful-softmax": OpenVINOTuning(attention="exact-softmax", stateful=True),
    "ov-stateful-fused": OpenVINOTuning(attention="fused", stateful=True),
    "ov-stateful-fused-f16": OpenVINOTuning(attention="fused", stateful=True, kv_precision="f16"),
    "ov-stateful-fused-bf16": OpenVINOTuning(attention="fused", stateful=True, kv_precision="bf16"),
    "ov-stateful-fused-u8": OpenVINOTuning(attention="fused", stateful=True, kv_precision="u8"),
}


@dataclass
class Row:
    name: str
    one_row_ms: float = float("nan")
    window_ms: float = float("nan")
    rollback_ms: float = float("nan")  # one rollback of 4 slots: a stateful cache reads, slices, writes its state
    max_diff: float = float("nan")
    flips: str = ""
    decode_tps: float = float("nan")
    sd_tps: float = float("nan")
    sd_parity: str = "-"
    ar_tokens: list = field(default_factory=list)
    same_ar: str = "-"  # prompts whose ar tokens equal the first variant's (ort first: the exported function)
    exact_setting: str = ""  # OpenVINOTuning.inexact(): "" = the runtime allows it for the target
    graph: dict = field(default_factory=dict)


def open_target(folder: Path, manifest, tuning: OpenVINOTuning | None, threads: int) -> TargetModel:
    """The target's three graphs on ONNX Runtime CPU (tuning None) or OpenVINO CPU with ``tuning``."""
    backend, device = ("onnxruntime", "cpu") if tuning is None else ("openvino", "CPU")
    timeline, sessions = Timeline(), {}
    for role in (names.PREFIX, names.EXIT_HEAD, names.SUFFIX):
        spec = manifest.graph(role)
        settings = SessionSettings(device, threads, "f32", openvino=tuning or OpenVINOTuning(),
                                   kv_pairs=kv_pairs(spec.kv))
        session = BACKENDS[backend](graph_path(folder, spec), settings)
        sessions[role] = GraphSession(spec, session, Placement("target", device, session.effective, backend, False),
                                      timeline)
    return TargetModel(sessions[names.PREFIX], sessions[names.EXIT_HEAD], sessions[names.SUFFIX])


def compiled_facts(compiled, rewrites: dict | None = None) -> dict:
    """What the OpenVINO plugin made of one graph: fused nodes, state, and the properties that matter here."""
    kinds = collections.Counter(n.get_rt_info()["layerType"].astype(str)
                                for n in compiled.get_runtime_model().get_ordered_ops())
    facts = {k: kinds[k] for k in ("ScaledDotProductAttention", "MemoryInput", "Softmax", "MatMul", "FullyConnected")
             if kinds[k]}
    for prop in ("DYNAMIC_QUANTIZATION_GROUP_SIZE", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS", "NUM_STREAMS"):
        facts[prop] = str(compiled.get_property(prop))
    if rewrites is not None:
        facts["rewrites"] = rewrites
    return facts


def step_costs(target: TargetModel, prompt: list[int], steps: int, row: Row) -> list[int]:
    """Greedy decode ``steps + WINDOW`` tokens one row at a time, then re-verify them as windows; fills ``row``."""
    target.reset(1, len(prompt) + steps + 2 * WINDOW)
    token = int(target.extend(prompt)[-1].argmax())
    tokens, one = [], []
    for _ in range(steps + WINDOW):
        tokens.append(token)
        start = time.perf_counter()
        token = int(target.extend([token])[-1].argmax())
        one.append(time.perf_counter() - start)
    target.truncate(len(prompt))
    worst, flips, windows, trims = 0.0, 0, [], []
    for step in range(steps):
        base, window = target.length, tokens[step: step + WINDOW]
        start = time.perf_counter()
        together = target.extend(window)  # [WINDOW, vocab]
        windows.append(time.perf_counter() - start)
        target.truncate(base + 1)  # as sd after a window whose drafts were all rejected
        start = time.perf_counter()
        target.prefix_cache.past_feeds()  # a cache applies a truncate when it is next fed (StateCache: the trim)
        target.suffix_cache.past_feeds()
        trims.append(time.perf_counter() - start)
        target.truncate(base)
        alone = np.stack([target.extend([t])[-1] for t in window])
        target.truncate(base + 1)
        worst = max(worst, float(np.abs(together - alone).max()))
        flips += int((together.argmax(-1) != alone.argmax(-1)).sum())
    row.one_row_ms = statistics.median(one) * 1e3
    row.window_ms = statistics.median(windows) * 1e3
    row.rollback_ms = statistics.median(trims) * 1e3
    row.max_diff, row.flips = worst, f"{flips}/{steps * WINDOW}"
    return tokens


def decode_rate(target: TargetModel, prompts: list[list[int]], tokens: int, eos, limit: int) -> tuple[float, list]:
    """Mean decode tok/s (first token excluded) of target-only greedy decoding, and the tokens of each prompt."""
    rates, outs = [], []
    for prompt in prompts:
        out = decode(target, TargetOnly(), prompt, DecodeSettings(tokens, eos, limit))
        rates.append((len(out.tokens) - 1) / (out.seconds - out.time_to_first_token_s))
        outs.append(out.tokens)
    return statistics.mean(rates), outs


def sd_parity(folder: Path, tuning: OpenVINOTuning, threads: int, prompts, tokens: int, reference) -> tuple:
    """sd (draft on ONNX Runtime CPU) with the target on OpenVINO as ``tuning`` says: tok/s and identical prompts."""
    request = DeviceRequest(target="openvino:CPU", draft="cpu", target_threads=threads, draft_threads=threads,
                            target_openvino=tuning)
    same, rates = 0, []
    with Pipeline.load(folder, request) as pipe:
        for prompt, want in zip(prompts, reference):
            result = pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=tokens))
            same += int(result.tokens == want)
            rates.append(result.stats.decode_tokens_per_second)
    return statistics.mean(rates), f"{same}/{len(prompts)}"


def measure(folder: Path, name: str, prompts, args, manifest) -> Row:
    tuning = VARIANTS[name]
    row = Row(name, exact_setting="(onnxruntime)" if tuning is None else (tuning.inexact() or "yes"))
    target = open_target(folder, manifest, tuning, args.threads)
    if tuning is not None:
        row.graph = {"suffix": compiled_facts(target.suffix.backend.compiled_model(), target.suffix.backend.rewrites)}
    step_costs(target, prompts[0], args.steps, row)
    limit = manifest.target.max_position_embeddings
    row.decode_tps, row.ar_tokens = decode_rate(target, prompts, args.tokens, manifest.tokenizer.eos_token_ids, limit)
    del target
    if tuning is not None and not tuning.inexact():
        row.sd_tps, row.sd_parity = sd_parity(folder, tuning, args.threads, prompts, args.tokens, row.ar_tokens)
    return row


DRAFT_VARIANTS = {"ort": None, "ov-as-exported": OpenVINOTuning(attention="as-exported"),
                  "ov-exact-softmax": OpenVINOTuning(attention="exact-softmax"),
                  "ov-fused": OpenVINOTuning(attention="fused")}


def draft_costs(folder: Path, manifest, prompt: list[int], threads: int, steps: int = 16) -> list[str]:
    """One draft forward (1 row) per setting, median over ``steps`` greedy tokens after ``prompt`` (ms)."""
    from mirrorsd.runtime.models import DraftModel

    spec, lines = manifest.graph(names.DRAFT), []
    for name, tuning in DRAFT_VARIANTS.items():
        backend, device = ("onnxruntime", "cpu") if tuning is None else ("openvino", "CPU")
        session = BACKENDS[backend](graph_path(folder, spec), SessionSettings(
            device, threads, "f32", openvino=tuning or OpenVINOTuning()))
        draft = DraftModel(GraphSession(spec, session, Placement("draft", device, session.effective, backend, False),
                                        Timeline()))
        draft.reset(len(prompt) + steps + 2)
        token, times = int(draft.extend(prompt)[-1].argmax()), []
        for _ in range(steps):
            start = time.perf_counter()
            token = int(draft.extend([token])[-1].argmax())
            times.append(time.perf_counter() - start)
        lines.append(f"| draft {name} | {statistics.median(times) * 1e3:.1f} |")
        print(lines[-1], flush=True)
    return lines


def genai_row(manifest, prompts, args) -> Row:
    """OpenVINO GenAI target-only, int4 IR, f32 hint, the same threads; and its compiled model's settings."""
    import openvino as ov
    import openvino_genai

    from mirrorsd.apps.peers import convert_to_openvino

    ir = convert_to_openvino(Path(manifest.target.source), manifest.export_options.get("target_precision", "int4"))
    props = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": args.threads}
    compiled = ov.Core().compile_model(str(ir / "openvino_model.xml"), "CPU",
                                       {k: str(v) for k, v in props.items()})
    row = Row("openvino-genai", exact_setting="(peer)", graph={"model": compiled_facts(compiled)})
    del compiled
    pipe = openvino_genai.LLMPipeline(str(ir), "CPU", **props)
    config = pipe.get_generation_config()
    config.max_new_tokens, config.do_sample = args.tokens, False
    config.stop_token_ids = set(manifest.tokenizer.eos_token_ids)
    rates, outs = [], []
    for prompt in prompts:
        result = pipe.generate(ov.Tensor(np.asarray([prompt], np.int64)), config)
        outs.append(list(result.tokens[0]))
        metrics = result.perf_metrics
        rates.append(1000.0 / metrics.get_tpot().mean)  # mean time per output token after the first, ms
    row.decode_tps = statistics.mean(rates)
    row.ar_tokens = [[int(t) for t in r] for r in outs]
    return row


def table(rows: list[Row]) -> str:
    lines = ["| variant | 1 row ms | 5 rows ms (steps) | rollback ms | window max abs diff | argmax flips "
             "| decode tok/s | ar = first row's ar | sd tok/s | sd = ar | allowed for the target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = r.window_ms / r.one_row_ms if r.one_row_ms == r.one_row_ms else float("nan")
        lines.append(f"| {r.name} | {r.one_row_ms:.1f} | {r.window_ms:.1f} ({steps:.2f}) | {r.rollback_ms:.1f} | "
                     f"{r.max_diff:.2e} | {r.flips} | {r.decode_tps:.2f} | {r.same_ar} | {r.sd_tps:.2f} | "
                     f"{r.sd_parity} | {r.exact_setting} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--prompts", type=int, default=3, help="SpecBench prompts (one per category, in order)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="windows re-verified for the invariance check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--genai", action="store_true")
    parser.add_argument("--draft", action="store_true", help="also time one draft forward per draft setting")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    from mirrorsd import specbench
    from mirrorsd.runtime.text import TextCodec

    manifest = load_manifest(args.folder)
    codec = TextCodec(args.folder, manifest)
    questions = specbench.first_per_category(specbench.read(), (), 1)[: args.prompts]
    prompts = [codec.encode(q.text) for q in questions]
    rows = []
    for name in args.variants.split(","):
        rows.append(measure(args.folder, name, prompts, args, manifest))
        same = sum(a == b for a, b in zip(rows[0].ar_tokens, rows[-1].ar_tokens))
        rows[-1].same_ar = f"{same}/{len(prompts)}"
        print(table(rows[-1:]).splitlines()[-1], json.dumps(rows[-1].graph), flush=True)
    if args.genai:
        rows.append(genai_row(manifest, prompts, args))
        same = sum(a == b[: len(a)] for a, b in zip(rows[0].ar_tokens, rows[-1].ar_tokens))  # b may run past EOS
        rows[-1].same_ar = f"{same}/{len(prompts)}"
        print(table(rows[-1:]).splitlines()[-1], json.dumps(rows[-1].graph), flush=True)
    drafts = draft_costs(args.folder, manifest, prompts[0], args.threads) if args.draft else []
    print(f"\n{len(prompts)} SpecBench prompts ({', '.join(q.category for q in questions)}) x {args.tokens} "
          f"tokens, {args.threads} threads, f32 inference precision hint\n{table(rows)}")
    if drafts:
        print("\n| draft setting | 1 row ms |\n|---|---|\n" + "\n".join(drafts))
    if args.output:
        args.output.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
