"""``mirrorsd bench``: AR, SD and Mirror-SD side by side on SpecBench prompts, in one run, on one machine.

Per prompt the modes run back to back in a rotating order (so drift in machine speed hits every mode alike), after
one warm-up generation per mode. Speedup = mean tokens/s of a mode / mean tokens/s of ``ar`` (SpecBench's
definition). Every speculative mode's tokens are compared with ``ar``'s: a difference is flagged, and classified as
a near-tie when ``ar``'s top-2 logit margin at that position is below the oracle's threshold.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from mirrorsd.errors import GenerationInputError

TIE_MARGIN = 1e-3  # same threshold as the tests' tie-aware oracle
# SpecBench's short-prompt categories. summarization and rag prompts run to ~800 tokens: their fp32 prefill alone
# costs about a minute per prompt and mode on 2 cores, so they are opt-in (--categories) on machines like this one.
DEFAULT_CATEGORIES = ("writing", "coding", "reasoning", "math_reasoning", "qa", "translation")


@dataclass(frozen=True)
class BenchOptions:
    model: Path
    modes: tuple[str, ...] = ("ar", "sd", "mirror")
    questions: Path | None = None
    categories: tuple[str, ...] = ()
    per_category: int = 2
    max_new_tokens: int = 128
    gamma: int = 4
    branches: int = 4
    branch_batch: int = 2
    target_threads: int | None = None
    draft_threads: int | None = None
    output: Path = Path("bench_out")
    warmup: bool = True
    baseline_threads: int | None = None  # also run ar alone with this many threads per session ("ar-Nt")


@dataclass
class PromptRun:
    question_id: int
    category: str
    mode: str
    tokens: list[int]
    stats: dict
    parity: str = "reference"  # reference | identical | near-tie | DIFFERENT


@dataclass
class BenchResult:
    options: BenchOptions
    runs: list[PromptRun] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    skipped: list[int] = field(default_factory=list)
    machine: dict = field(default_factory=dict)


VARIANTS = {  # bench mode name -> GenerationConfig fields
    "ar": {"mode": "ar"},
    "sd": {"mode": "sd"},
    "mirror": {"mode": "mirror"},
    "mirror-noexit": {"mode": "mirror", "exit_head": False},  # draft runner-ups only: no exit-head pass
    "mirror-cap": {"mode": "mirror", "branch_budget": "cap"},  # every step rolls out all branches
    # an export with a streaming draft streams by default; these run its plain draft graph instead
    "sd-nostream": {"mode": "sd", "streaming": False},
    "mirror-nostream": {"mode": "mirror", "streaming": False},
}


def variant(mode: str) -> dict:
    if mode not in VARIANTS:
        raise GenerationInputError(f"Unknown bench mode '{mode}'", f"modes are {', '.join(VARIANTS)}", "pick from those")
    return VARIANTS[mode]


def default_questions() -> Path:
    env = os.environ.get("MIRRORSD_SPEC_BENCH")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" / "spec_bench" / "question.jsonl" for p in here.parents]
    for path in candidates:
        if path.is_file():
            return path
    raise GenerationInputError("SpecBench questions not found", "no question.jsonl beside the project",
                               "pass --questions PATH or set MIRRORSD_SPEC_BENCH")


def load_questions(path: Path, categories: tuple[str, ...], per_category: int) -> list[dict]:
    """The first ``per_category`` questions of each category, in file order (a fixed subset), first turn only."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    available = list(dict.fromkeys(r["category"] for r in rows))
    wanted = categories or tuple(c for c in DEFAULT_CATEGORIES if c in available) or tuple(available)
    unknown = set(wanted) - set(available)
    if unknown:
        raise GenerationInputError(f"Unknown SpecBench categories {sorted(unknown)}",
                                   f"the file has {', '.join(available)}", "pick from those")
    picked = []
    for category in wanted:
        picked += [r for r in rows if r["category"] == category][:per_category]
    return picked


def run_bench(options: BenchOptions, progress=True) -> BenchResult:
    import resource

    from tqdm import tqdm

    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    questions = load_questions(options.questions or default_questions(), options.categories, options.per_category)
    devices = DeviceRequest(target_threads=options.target_threads, draft_threads=options.draft_threads)
    result = BenchResult(options, machine=_machine())
    baseline = {}
    if options.baseline_threads:
        baseline = _baseline_pass(options, questions, progress)
    with Pipeline.load(options.model, devices) as pipe:
        configs = {mode: GenerationConfig(max_new_tokens=options.max_new_tokens, gamma=options.gamma,
                                          branches=options.branches, branch_batch=options.branch_batch,
                                          record_margins=(mode == "ar"), **variant(mode)) for mode in options.modes}
        if options.warmup:
            for config in configs.values():
                pipe.generate("Say hello.", GenerationConfig(**{**config.__dict__, "max_new_tokens": 8}))
        bar = tqdm(total=len(questions) * len(configs), disable=not progress, desc="bench", unit="gen")
        for i, question in enumerate(questions):
            prompt = question["turns"][0]
            if len(pipe.encode(prompt, configs[options.modes[0]])) + options.max_new_tokens > pipe.context_limit:
                result.skipped.append(question["question_id"])  # does not fit the exported context
                bar.update(len(configs))
                continue
            order = list(configs)[i % len(configs):] + list(configs)[: i % len(configs)]
            outs = {}
            for mode in order:
                outs[mode] = pipe.generate(prompt, configs[mode])
                bar.update(1)
            outs.update(baseline.get(question["question_id"], {}))
            reference = outs.get("ar")
            for mode in outs:
                out = outs[mode]
                run = PromptRun(question["question_id"], question["category"], mode, out.tokens,
                                out.stats.to_dict())
                if reference is not None and mode != "ar":
                    run.parity = classify_parity(reference.tokens, out.tokens, reference.margins)
                result.runs.append(run)
        bar.close()
    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return result


def _baseline_pass(options: BenchOptions, questions: list[dict], progress: bool) -> dict:
    """``ar`` with ``baseline_threads`` threads, in its own pipeline (sessions cannot change thread counts)."""
    from tqdm import tqdm

    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    n = options.baseline_threads
    config = GenerationConfig(mode="ar", max_new_tokens=options.max_new_tokens)
    outs = {}
    with Pipeline.load(options.model, DeviceRequest(target_threads=n, draft_threads=n)) as pipe:
        if options.warmup:
            pipe.generate("Say hello.", GenerationConfig(mode="ar", max_new_tokens=8))
        for question in tqdm(questions, disable=not progress, desc=f"ar-{n}t", unit="gen"):
            prompt = question["turns"][0]
            if len(pipe.encode(prompt, config)) + options.max_new_tokens <= pipe.context_limit:
                outs[question["question_id"]] = {f"ar-{n}t": pipe.generate(prompt, config)}
    return outs


def classify_parity(reference: list[int], tokens: list[int], margins: list[float]) -> str:
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return "near-tie" if i < len(margins) and margins[i] < TIE_MARGIN else "DIFFERENT"
    return "identical" if len(reference) == len(tokens) else "DIFFERENT"


def _machine() -> dict:
    import platform

    import onnxruntime

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
