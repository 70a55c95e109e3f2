"""``mirrorsd bench``: AR, SD and Mirror-SD side by side on SpecBench prompts, in one run, on one machine.

Per prompt the modes run back to back in a rotating order (so drift in machine speed hits every mode alike), after
one warm-up generation per mode. Speedup = mean tokens/s of a mode / mean tokens/s of ``ar`` (SpecBench's
definition). Every speculative mode's tokens are compared with ``ar``'s: a difference is flagged, and classified as
a near-tie when ``ar``'s top-2 logit margin at that position is below the oracle's threshold.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from mirrorsd import specbench
from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime.config import AUTO, MODES, GenerationConfig
from mirrorsd.specbench import Question

TIE_MARGIN = 1e-3  # same threshold as the tests' tie-aware oracle


@dataclass(frozen=True)
class BenchOptions:
    """What ``mirrorsd bench`` runs; the generation settings default to GenerationConfig's."""

    model: Path
    modes: tuple[str, ...] = (*MODES, AUTO)
    questions: Path | None = None  # SpecBench question.jsonl (default: specbench.default_path())
    categories: tuple[str, ...] = ()  # default: specbench.DEFAULT_CATEGORIES
    per_category: int = 2  # the first N of each category (<= specbench.HOLDOUT: prompts no trainer trained on)
    max_new_tokens: int = GenerationConfig.max_new_tokens
    gamma: int = GenerationConfig.gamma
    branches: int = GenerationConfig.branches
    branch_batch: int = GenerationConfig.branch_batch
    target_threads: int | None = None
    draft_threads: int | None = None
    output: Path = Path("bench_out")
    warmup: bool = True
    baseline_threads: int | None = None  # also run ar alone with this many threads per session ("ar-Nt")
    peer_target: Path | None = None  # HF folders for the peer modes (default: the export's sources)
    peer_draft: Path | None = None
    peer_target_gguf: Path | None = None  # GGUFs for the llama-* modes (default: the ones the HF folders came from)
    peer_draft_gguf: Path | None = None
    bandwidth: bool = True  # measure the memory-bandwidth ceiling of ar in the same run
    native_library: Path | None = None  # libmirrorsd for the c-* modes (default: built into the mirrorsd cache)
    kernels: str = "auto"  # MatMulNBits on ONNX Runtime CPU: auto | mirrorsd | ort (devices/kernel_choice.py)
    # mirrorsd's modes on one spinning ONNX Runtime pool (devices/thread_pool.py); None: where it can
    shared_pool: bool | None = None


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
    ceilings: list = field(default_factory=list)  # mirrorsd.apps.bandwidth.Ceiling per thread count
    chat: bool = True  # prompts through the export's chat template; False: raw completion (it has none)
    costs: object = None  # the profile's SplitCosts of the fixed modes' pipeline (measured when auto runs)
    auto_costs: object = None  # the SplitCosts of the split mode auto ran on (its own pipeline's profile)
    latency: list = field(default_factory=list)  # latency_check.CheckRow per fixed mode: predicted vs measured


STOP_THRESHOLD = 0.8  # sd-stop's threshold: the best of the replayed grid on the Qwen pair (docs/performance.md)
VARIANTS = {  # bench mode name -> GenerationConfig fields
    **{mode: {"mode": mode} for mode in (*MODES, AUTO)},  # auto: the mode the latency model picks (its why: stats)
    "sd-ngram": {"mode": "sd", "ngram": True},  # sd whose draft checks a prompt-lookup guess as lookahead
    # sd whose windows end after the draft's first pick below STOP_THRESHOLD (GenerationConfig.draft_confidence)
    "sd-stop": {"mode": "sd", "draft_confidence": STOP_THRESHOLD},
    "sd-stop-ngram": {"mode": "sd", "draft_confidence": STOP_THRESHOLD, "ngram": True},
    "mirror-ngram": {"mode": "mirror", "ngram": True},  # the same for mirror's fresh windows (misses)
    "auto-nolookahead": {"mode": AUTO, "ngram": False},  # auto whose sd and mirror run without that lookahead
    "mirror-noexit": {"mode": "mirror", "exit_head": False},  # draft runner-ups only: no exit-head pass
    "mirror-cap": {"mode": "mirror", "branch_budget": "cap"},  # every step rolls out all branches
    # more branches per step in wider batches (3 rows cost little more than 2 for a bandwidth-bound int4 draft)
    "mirror-wide": {"mode": "mirror", "exit_head": False, "branches": 6, "branch_batch": 3},
    # an export with a streaming draft streams by default; these run its plain draft graph instead
    "sd-nostream": {"mode": "sd", "streaming": False},
    "mirror-nostream": {"mode": "mirror", "streaming": False},
}


# The same decoders in C++ (libmirrorsd, runtime/native) through ctypes: bench mode -> NativeModel.generate fields
NATIVE_VARIANTS = {
    "c-ar": {"mode": "ar"},
    "c-sd": {"mode": "sd"},
    "c-mirror": {"mode": "mirror"},
    "c-mirror-noexit": {"mode": "mirror", "exit_head": False},
}


def runs_auto(modes) -> bool:
    return any(VARIANTS.get(mode, {}).get("mode") == AUTO for mode in modes)


def variant(mode: str) -> dict:
    from mirrorsd.apps.peers import PEER_MODES

    if mode in PEER_MODES:
        return {}
    if mode in NATIVE_VARIANTS:
        return NATIVE_VARIANTS[mode]
    if mode not in VARIANTS:
        raise GenerationInputError(f"Unknown bench mode '{mode}'",
                                   f"modes are {', '.join([*VARIANTS, *NATIVE_VARIANTS, *PEER_MODES])}",
                                   "pick from those")
    return VARIANTS[mode]


def check_options(options: BenchOptions) -> None:
    """What can be checked before anything loads: the modes, and every number (the generation settings through
    GenerationConfig's own check, counts and threads in their ranges)."""
    from mirrorsd import ranges

    if not options.modes:
        raise GenerationInputError("--modes names no mode", "a bench compares modes; the list was empty",
                                   "pass for example --modes ar,sd,mirror")
    for mode in options.modes:
        variant(mode)
    ranges.check(options, {"per_category": ranges.Range(1), "target_threads": ranges.threads(),
                           "draft_threads": ranges.threads(), "baseline_threads": ranges.threads()},
                 GenerationInputError)
    GenerationConfig(max_new_tokens=options.max_new_tokens, gamma=options.gamma, branches=options.branches,
                     branch_batch=options.branch_batch).check()


def run_bench(options: BenchOptions, progress=True) -> BenchResult:
    """Our modes first (one pipeline, rotating order per prompt), then each peer family in its own pass on the same
    prompt token ids (one family loaded at a time: a second fp32 target beside ours would not fit 24 GiB)."""
    import resource

    from mirrorsd.apps.peers import is_peer_mode

    check_options(options)  # unknown modes fail before anything loads
    questions = specbench.first_per_category(specbench.read(options.questions), options.categories,
                                             options.per_category)
    result = BenchResult(options, machine=_machine())
    baseline = _baseline_pass(options, questions, progress) if options.baseline_threads else {}
    ours = [m for m in options.modes if not is_peer_mode(m)]
    peers = [m for m in options.modes if is_peer_mode(m)]
    if options.bandwidth:
        from mirrorsd.apps.bandwidth import ceilings
        from mirrorsd.manifest import load_manifest

        counts = tuple(sorted({own_threads(options), options.baseline_threads or 1, os.cpu_count() or 1}))
        result.ceilings = ceilings(options.model, load_manifest(options.model), counts)
    outs, prompt_ids, manifest = _own_pass(options, ours, questions, result, progress)
    if peers:
        _peer_passes(options, peers, questions, prompt_ids, manifest, outs, progress)
    for question in questions:
        qid = question.question_id
        if qid not in prompt_ids:
            continue
        runs = {**outs.get(qid, {}), **baseline.get(qid, {})}
        reference = runs.get("ar")
        for mode, out in runs.items():
            run = PromptRun(qid, question.category, mode, out.tokens, _stats_dict(out))
            if reference is not None and mode != "ar":
                run.parity = classify_parity(reference.tokens, out.tokens, reference.margins)
            result.runs.append(run)
    if result.costs is not None:
        from mirrorsd.apps.latency_check import check

        result.latency = check(result.costs, result.runs, options.gamma, result.auto_costs)
    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return result


def has_chat_template(pipe) -> bool:
    """Prompts go through the chat template when the export has one, else as raw completion (base models)."""
    return bool(pipe.manifest.tokenizer.chat_template)


def rotated(modes: list[str], i: int) -> list[str]:
    """Prompt i runs the modes starting at the i-th: drift in machine speed hits every mode alike."""
    k = i % len(modes) if modes else 0
    return modes[k:] + modes[:k]


def own_threads(options: BenchOptions) -> int:
    """Intra-op threads of each of our sessions in this run (the Pipeline's default when not given)."""
    from mirrorsd.devices.backends import default_threads

    return options.target_threads or default_threads()


@contextlib.contextmanager
def _concurrent_pipeline(options: BenchOptions, modes: list[str], devices):
    """The pipeline the modes that run the draft beside the target (mirror and its variants) run in: one whose ONNX
    Runtime pools sleep between sections (what `mirrorsd generate --mode mirror` opens; the other modes' pipeline
    spins within a run, DeviceRequest.spin_in_run); None when no such mode is asked."""
    from dataclasses import replace

    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.config import spins_in_run

    if all(spins_in_run(VARIANTS.get(mode, {}).get("mode", "")) for mode in modes):
        yield None
        return
    with Pipeline.load(options.model, replace(devices, spin_in_run=False)) as concurrent:
        yield concurrent


@contextlib.contextmanager
def _auto_pipeline(options: BenchOptions, modes: list[str], devices, pipe):
    """The pipeline mode auto runs in: its own one with the placement and thread split the cached profiles predict
    fastest (runtime/planner/placement.py), when that differs from the other modes' pipeline; else ``pipe``."""
    from dataclasses import replace

    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner import loading

    if not runs_auto(modes):
        yield pipe
        return
    request, choice = loading.planned_request(pipe.folder, pipe.manifest, replace(devices, plan_from_profile=True),
                                              pipe.here())
    if request is None:
        pipe.planner.thread_choice, pipe.planner.placement_choice = choice.threads, choice
        yield pipe
        return
    with Pipeline.load(options.model, replace(request, plan_from_profile=False)) as own:
        own.planner.thread_choice, own.planner.placement_choice = choice.threads, choice
        yield own


def _stats_dict(out) -> dict:
    return out.stats if isinstance(out.stats, dict) else out.stats.to_dict()


def _own_pass(options: BenchOptions, modes: list[str], questions: list[Question], result: BenchResult,
              progress: bool):
    """mirrorsd's own modes; returns (outputs by question and mode, prompt ids by question, manifest)."""
    from tqdm import tqdm

    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline
    from mirrorsd.runtime.config import spins_in_run

    devices = DeviceRequest(target_threads=options.target_threads, draft_threads=options.draft_threads,
                            kernels=options.kernels, shared_pool=options.shared_pool, spin_in_run=True)
    outs: dict = {}
    prompt_ids: dict = {}
    shared = dict(max_new_tokens=options.max_new_tokens, gamma=options.gamma, branches=options.branches,
                  branch_batch=options.branch_batch)
    native_modes = [m for m in modes if m in NATIVE_VARIANTS]
    with Pipeline.load(options.model, devices) as pipe, _native_model(options, native_modes) as native, \
            _auto_pipeline(options, modes, devices, pipe) as auto_pipe, \
            _concurrent_pipeline(options, modes, devices) as concurrent_pipe:

        def runs_in(config):  # auto: the planned pipeline; mirror: one whose pools sleep; the rest: pipe
            return auto_pipe if config.mode == AUTO else pipe if spins_in_run(config.mode) else concurrent_pipe

        result.chat = has_chat_template(pipe)
        configs = {mode: GenerationConfig(**{**shared, "record_margins": mode == "ar", "chat": result.chat,
                                             **variant(mode)})
                   for mode in modes if mode not in NATIVE_VARIANTS}
        configs.update({mode: _NativeRun(native, mode, {**shared, **variant(mode)}) for mode in native_modes})
        encode_config = GenerationConfig(max_new_tokens=options.max_new_tokens, chat=result.chat)
        if options.warmup:
            for config in configs.values():
                if isinstance(config, _NativeRun):
                    config.warm_up(pipe.encode("Say hello.", encode_config))
                else:
                    runs_in(config).generate(
                        "Say hello.", GenerationConfig(**{**config.__dict__, "max_new_tokens": 8}))
        bar = tqdm(total=len(questions) * len(configs), disable=not progress or not configs, desc="bench", unit="gen")
        for i, question in enumerate(questions):
            ids = pipe.encode(question.text, encode_config)
            if len(ids) + options.max_new_tokens > pipe.context_limit:
                result.skipped.append(question.question_id)  # does not fit the exported context
                bar.update(len(configs))
                continue
            prompt_ids[question.question_id] = ids
            for mode in rotated(list(configs), i):
                config = configs[mode]
                run = config(ids) if isinstance(config, _NativeRun) else runs_in(config).generate(ids, config)
                outs.setdefault(question.question_id, {})[mode] = run
                bar.update(1)
        bar.close()
        manifest = pipe.manifest
        if runs_auto(modes):  # auto plans from the profile anyway: check its latency model against the fixed modes
            pipe.profile()
            result.costs = pipe.planner.costs(pipe.thread_key)
            if auto_pipe.planner.loaded is not None:
                result.auto_costs = auto_pipe.planner.costs(auto_pipe.thread_key)
    return outs, prompt_ids, manifest


class _NativeRun:
    """One c-* mode: the C++ library's decoder on the same prompt ids, with the same settings and threads."""

    def __init__(self, native, mode: str, settings: dict) -> None:
        self.native, self.mode, self.settings = native, mode, settings

    def __call__(self, ids: list[int]):
        from mirrorsd.apps.peers import PeerOutput

        out = self.native.generate(ids, **self.settings)
        return PeerOutput(out.tokens, {**out.stats, "mode": self.mode})

    def warm_up(self, ids: list[int]) -> None:
        self.native.generate(ids, **{**self.settings, "max_new_tokens": 8})


def _native_model(options: BenchOptions, modes: list[str]):
    """libmirrorsd on the bench's export folder with our sessions' threads and MatMulNBits kernels (--kernels), or
    nothing when no c-* mode is asked."""
    import contextlib

    if not modes:
        return contextlib.nullcontext()
    from mirrorsd.runtime.native import NativeModel, build_library

    threads = own_threads(options)
    return NativeModel(options.model, options.native_library or build_library(),
                       target_threads=options.target_threads or threads,
                       draft_threads=options.draft_threads or threads, kernels=options.kernels)


def _peer_passes(options: BenchOptions, modes: list[str], questions: list[Question], prompt_ids: dict, manifest,
                 outs: dict, progress: bool) -> None:
    """Each peer family loaded once, warmed up, run on every prompt (its modes in rotating order), then closed."""
    from tqdm import tqdm

    from mirrorsd.apps.peers import PeerModels, families, hf_folder, open_peer

    precisions = manifest.export_options
    models = PeerModels(
        target=hf_folder(options.peer_target or manifest.target.source, "target"),
        draft=hf_folder(options.peer_draft or manifest.draft.source, "draft"),
        target_precision=str(precisions.get("target_precision") or "fp32"),
        draft_precision=str(precisions.get("draft_precision") or "fp32"),
        target_gguf=options.peer_target_gguf, draft_gguf=options.peer_draft_gguf)
    eos = tuple(manifest.tokenizer.eos_token_ids)
    for family, family_modes in families(modes).items():
        peer = open_peer(family, family_modes, models, eos, progress)
        try:
            if options.warmup:
                warm = next(iter(prompt_ids.values()), [1])
                for mode in family_modes:
                    peer.generate(mode, warm, 8, options.gamma)
            bar = tqdm(total=len(prompt_ids) * len(family_modes), disable=not progress, desc=family, unit="gen")
            for i, question in enumerate(q for q in questions if q.question_id in prompt_ids):
                ids = prompt_ids[question.question_id]
                for mode in rotated(family_modes, i):
                    outs.setdefault(question.question_id, {})[mode] = peer.generate(
                        mode, ids, options.max_new_tokens, options.gamma)
                    bar.update(1)
            bar.close()
        finally:
            peer.close()


def _baseline_pass(options: BenchOptions, questions: list[Question], progress: bool) -> dict:
    """``ar`` (and ``sd`` when asked for) with ``baseline_threads`` threads per session, in their own pipeline
    (sessions cannot change thread counts): reported as ``ar-Nt`` / ``sd-Nt``. Serial modes never run two sessions
    at once, so on a CPU these are their best settings; Mirror-SD's two concurrent sessions split the cores."""
    from tqdm import tqdm

    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    n = options.baseline_threads
    outs: dict = {}
    shared = False if options.shared_pool is False else None  # where it can: the process's pool may be another size
    with Pipeline.load(options.model, DeviceRequest(target_threads=n, draft_threads=n, kernels=options.kernels,
                                                    shared_pool=shared, spin_in_run=True)) as pipe:
        chat = has_chat_template(pipe)
        configs = {f"{mode}-{n}t": GenerationConfig(mode=mode, max_new_tokens=options.max_new_tokens,
                                                    gamma=options.gamma, chat=chat)
                   for mode in ("ar", "sd") if mode == "ar" or mode in options.modes}
        if options.warmup:
            for config in configs.values():
                pipe.generate("Say hello.", GenerationConfig(**{**config.__dict__, "max_new_tokens": 8}))
        for i, question in enumerate(tqdm(questions, disable=not progress, desc=f"{n} threads", unit="prompt")):
            prompt = question.text
            if len(pipe.encode(prompt, GenerationConfig(chat=chat))) + options.max_new_tokens > pipe.context_limit:
                continue
            outs[question.question_id] = {name: pipe.generate(prompt, configs[name])
                                             for name in rotated(list(configs), i)}
    return outs


def classify_parity(reference: list[int], tokens: list[int], margins: list[float]) -> str:
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return "near-tie" if i < len(margins) and margins[i] < TIE_MARGIN else "DIFFERENT"
    return "identical" if len(reference) == len(tokens) else "DIFFERENT"


# CPU features that decide which kernels a decoder (ours or a peer's) can use
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_facts(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and which of CPU_FLAGS it has, from /proc/cpuinfo (``cpuinfo``: its text, for tests)."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    present = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or "unknown",
            "cpu_flags": " ".join(f for f in CPU_FLAGS if f in present) or "none of " + " ".join(CPU_FLAGS)}


def _machine() -> dict:
    import platform

    import onnxruntime

    return {**cpu_facts(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
