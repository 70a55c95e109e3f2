"""Measure a loaded pipeline at the shapes the runtime uses: the costs of its thread split, and the pair's acceptance.

Every function reads the pipeline through a PipelineView (view.py): its models, timelines, placement and threads,
and the generate call the calibration runs.

    target     prefix, exit head and suffix at window widths 1 .. gamma_max + 1 (the decode loop's verification,
               with the host's argmax), on a cache holding the calibration prompt. The exit head timed is the one
               Mirror-SD runs: the sparse head (exit_sparse.onnx, scoring the draft's runner_up_k candidates per
               row) when the folder has one, else the full head; with a sparse head the full one is timed as well
               (detail ``exit_full_s``, for the exit-layer table)
    draft      one row, g tokens through the rollout engine (sd's window; mirror's fallback); a batch of
               branch_batch branch rows (mirror's rollouts); the streaming draft's windows when the export has one
    contention the target's verification while the draft rolls out branches on another thread, and the draft's
               branch forward while the target verifies (on one CPU both share the cores and the memory bus)
    acceptance a short Mirror-SD calibration run (with and without the exit head): mean accepted tokens -> alpha,
               and the reuse rates; a short sd run at window MAX_GAMMA with the draft's pick probabilities
               recorded: the draft-confidence stops replayed on its windows (planner/stops.py)

Times are medians of ``repeats`` runs after one warm-up. The result is cached per export and device set
(runtime/planner/profile.py); ``profile_for`` measures only what the cache lacks.
"""
from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from mirrorsd.runtime.planner import profile as profiles
from mirrorsd.runtime.config import GenerationConfig
from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, alpha_from_mean_accepted, split_name
from mirrorsd.runtime.planner.stops import StopCounts, StopReplay
from mirrorsd.runtime.planner.view import PipelineView
from mirrorsd.runtime.rollout import branches, fresh
from mirrorsd.runtime.sampling import GREEDY
from mirrorsd.runtime.verify import Branch, greedy_tokens

MAX_GAMMA = 6  # widths 1 .. 7 are measured: auto picks gamma in 1 .. MAX_GAMMA
REPEATS = 7
TARGET_CONTEXT = 112  # cached tokens under the target's measured windows: a typical prompt plus part of its answer
# One prompt per SpecBench short-prompt category (mirrorsd/specbench.DEFAULT_CATEGORIES), written for mirrorsd: a
# pair's acceptance ranges widely between them (far higher on code than on prose), and fewer prompts covered only
# some of them. Measured over the first 32 tokens of each answer it is still higher than over whole answers
# (docs/profile.md); generations correct it online. The first prompt also holds the cache under the measured target
# windows.
CALIBRATION_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works.",  # coding
    "Write a short letter to a neighbour asking them to water your plants while you are away.",  # writing
    "A shop sells pens in packs of 4 and packs of 6. What is the smallest number of packs that holds exactly 22 "
    "pens? Show your reasoning.",  # reasoning
    "Solve for x: 3x + 7 = 2x - 5. Explain each step.",  # math_reasoning
    "Why does the sky look blue during the day and red at sunset?",  # qa
    "Translate into French: The train leaves at seven, so we should have breakfast early.",  # translation
)
CALIBRATION_TOKENS = 32


class _ExitSink:
    """An early-exit callback that drops the message; ``draft_top`` (the draft's top-k at each window position)
    makes the target run its sparse exit head, as Mirror-SD's hand-off does (models.TargetModel._exit_message)."""

    def __init__(self, draft_top: np.ndarray | None = None) -> None:
        self.draft_top = draft_top

    def __call__(self, ids, logprobs) -> None:
        pass


def exit_sink(view: PipelineView, prompt: list[int], rows: int, full: bool = False) -> _ExitSink:
    """The callback that times the exit head Mirror-SD runs on a verification of ``rows`` rows (the full head when
    ``full`` or when the folder has no sparse one)."""
    if full or view.target.exit_sparse is None:
        return _ExitSink()
    k = GenerationConfig.runner_up_k
    ids = np.resize(np.asarray(prompt, np.int64), (max(rows - 1, 1), k))  # the window's candidates: any valid ids
    return _ExitSink(ids)


def exit_kind(view: PipelineView) -> str:
    return "sparse" if view.target.exit_sparse is not None else "full"


def calibration_ids(view: PipelineView, text: str = CALIBRATION_PROMPTS[0]) -> list[int]:
    chat = bool(view.manifest.tokenizer.chat_template)
    return view.encode(text, GenerationConfig(chat=chat))


def measure_split(view: PipelineView, max_gamma: int = MAX_GAMMA, repeats: int = REPEATS, tick=lambda: None
                  ) -> tuple[SplitCosts, dict]:
    """The costs of ``view``'s own placement and thread split; and the per-graph detail behind them."""
    prompt = calibration_ids(view)
    branch_batch = GenerationConfig.branch_batch
    target = _target_costs(view, prompt, max_gamma, repeats, tick)
    draft1, branch_fwd, stream, prefill = _draft_costs(view, prompt, max_gamma, branch_batch, repeats, tick)
    c_target, c_draft = _contention(view, prompt, max_gamma, branch_batch, repeats, target, branch_fwd)
    tick()
    t_threads, d_threads = view.threads
    costs = SplitCosts(target_threads=t_threads, draft_threads=d_threads, verify_s=target["verify_s"],
                       exit_s=target["exit_s"], draft1_s=draft1, branch_fwd_s=branch_fwd, branch_batch=branch_batch,
                       c_target=c_target, c_draft=c_draft, stream_window_s=stream, draft_prefill_s=prefill,
                       prefix_s=tuple(target["prefix_parts"]), shared_pool=view.shared_pool,
                       label=f"target {view.placement['prefix']} x{t_threads}, "
                             f"draft {view.placement['draft']} x{d_threads}, {exit_kind(view)} exit head")
    detail = {k: [round(x, 6) for x in v] for k, v in target.items() if k.endswith("_parts") or k == "exit_full_s"}
    detail.update({"prompt_tokens": len(prompt), "repeats": repeats, "exit_head": exit_kind(view),
                   "exit_layer": view.manifest.exit_layer, "layers": view.manifest.target.num_layers})
    return costs, detail


def _median(values) -> float:
    return float(statistics.median(values))


def _target_costs(view: PipelineView, prompt: list[int], max_gamma: int, repeats: int, tick) -> dict:
    """Every width in each round (rounds interleave the widths, so drift in machine speed hits them alike), on a
    cache of TARGET_CONTEXT tokens (a prompt plus part of its answer)."""
    target, timeline = view.target, view.target_timeline
    context = (prompt * (TARGET_CONTEXT // len(prompt) + 1))[:max(TARGET_CONTEXT, len(prompt))]
    target.reset(1, len(context) + max_gamma + 8)
    target.extend(context)
    base = target.length
    window = (prompt * (max_gamma + 2))[: max_gamma + 1]
    widths = range(1, max_gamma + 2)
    runs = {w: {"wall": [], "exit": [], "full": [], "prefix": [], "suffix": []} for w in widths}
    variants = ("none", "exit", "full") if view.target.exit_sparse is not None else ("none", "exit")
    for r in range(repeats + 1):
        for w in widths:
            for variant in variants:
                sink = None if variant == "none" else exit_sink(view, window, w, full=variant == "full")
                timeline.clear()
                start = time.perf_counter()
                logits = target.extend(window[:w], sink)
                greedy_tokens(logits)  # the decode loop's verification
                wall = time.perf_counter() - start
                target.truncate(base)
                if r == 0:
                    continue  # warm-up: a new shape may compile or allocate
                spans = [e - s for s, e in timeline.intervals]
                if variant != "none":
                    runs[w][variant].append(spans[1])
                else:
                    runs[w]["wall"].append(wall)
                    runs[w]["prefix"].append(spans[0])
                    runs[w]["suffix"].append(spans[-1])
        tick()
    timeline.clear()
    verify = [_median(runs[w]["wall"]) for w in widths]
    prefix = [_median(runs[w]["prefix"]) for w in widths]
    suffix = [_median(runs[w]["suffix"]) for w in widths]
    out = {"verify_s": tuple(verify), "exit_s": tuple(_median(runs[w]["exit"]) for w in widths),
           "prefix_parts": prefix, "suffix_parts": suffix,
           "host_parts": [v - p - q for v, p, q in zip(verify, prefix, suffix)]}
    if "full" in variants:
        out["exit_full_s"] = [_median(runs[w]["full"]) for w in widths]
    return out


def _branch_setup(view: PipelineView, prompt: list[int], gamma: int, batch_rows: int):
    """A drafted window with the main cache holding prompt + window (as Mirror-SD's worker has it), and a batch of
    branches at depths 1 .. batch_rows with the draft's runner-up tokens."""
    draft, k = view.draft, GenerationConfig.runner_up_k
    draft.reset(capacity=len(prompt) + 4 * gamma + 16)
    window = fresh(draft, prompt, gamma, GREEDY, k)
    draft.extend([int(window.tokens[-1])])
    batch = [Branch(d, int(window.top_ids[d - 1][min(1, k - 1)]), 0.0) for d in range(1, batch_rows + 1)]
    return window, batch


def _draft_costs(view: PipelineView, prompt: list[int], gamma: int, batch_rows: int, repeats: int, tick):
    draft = view.draft
    prefills = []
    for r in range(2):  # the draft's prefill of the whole prompt (sd pays it in its first step); warm-up first
        draft.reset(capacity=len(prompt) + 4 * gamma + 16)
        start = time.perf_counter()
        draft.prefill(prompt)  # as sd reads a prompt: chunks that score their last row only where the graph can
        prefills.append((time.perf_counter() - start) / len(prompt))
    prefill = prefills[-1]
    fresh(draft, prompt, gamma)  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fresh(draft, prompt, gamma)  # g forwards of one token after the prompt
        runs.append((time.perf_counter() - start) / gamma)
    draft1 = _median(runs)
    tick()
    window, batch = _branch_setup(view, prompt, gamma, batch_rows)
    runs = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        branches(draft, prompt, window.tokens, batch, GREEDY, GenerationConfig.runner_up_k, False)
        if r:
            runs.append((time.perf_counter() - start) / gamma)  # one forward per window token
    branch_fwd = _median(runs)
    tick()
    stream = ()
    streaming = view.streaming_draft
    if streaming is not None:
        streaming.reset(capacity=len(prompt) + 4 * gamma + 16)
        fresh(streaming, prompt, gamma, lookahead=True)
        times = []
        for g in range(1, gamma + 1):
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                fresh(streaming, prompt, g, lookahead=True)
                runs.append(time.perf_counter() - start)
            times.append(_median(runs))
        stream = tuple(times)
    return draft1, branch_fwd, stream, prefill


def _contention(view: PipelineView, prompt: list[int], gamma: int, batch_rows: int, repeats: int, target: dict,
                branch_fwd: float) -> tuple[float, float]:
    """Slowdown of the target's verification (gamma + 1 rows, exit head) while the draft rolls out branches on
    another thread, and of the draft's branch forward meanwhile; 1.0 when they do not slow each other."""
    window, batch = _branch_setup(view, prompt, gamma, batch_rows)
    model = view.target
    model.reset(1, len(prompt) + gamma + 8)
    model.extend(prompt)
    base = model.length
    tokens = (prompt * (gamma + 2))[: gamma + 1]
    stop, draft_runs, failures = threading.Event(), [], []

    def roll() -> None:
        try:
            while not stop.is_set():
                start = time.perf_counter()
                branches(view.draft, prompt, window.tokens, batch, GREEDY, GenerationConfig.runner_up_k, False)
                draft_runs.append((time.perf_counter() - start) / gamma)
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread
            failures.append(exc)

    worker = threading.Thread(target=roll, name="mirrorsd-profile-draft", daemon=True)
    worker.start()
    walls = []
    try:
        for r in range(2 * repeats + 1):
            start = time.perf_counter()
            greedy_tokens(model.extend(tokens, exit_sink(view, tokens, len(tokens))))
            if r:
                walls.append(time.perf_counter() - start)
            model.truncate(base)
    finally:
        stop.set()
        worker.join()
    if failures:
        raise failures[0]
    alone = target["verify_s"][gamma] + target["exit_s"][gamma]
    c_target = max(1.0, _median(walls) / alone)
    c_draft = max(1.0, _median(draft_runs[1:] or draft_runs) / branch_fwd) if draft_runs else 1.0
    view.target_timeline.clear()
    view.draft_timeline.clear()
    return c_target, c_draft


def calibrate(view: PipelineView, gamma: int = GenerationConfig.gamma, tokens: int = CALIBRATION_TOKENS,
              tick=lambda: None) -> tuple[Acceptance, dict]:
    """Acceptance of the pair from short Mirror-SD runs (with and without the exit head) on the calibration
    prompts: alpha from the mean accepted tokens, and the reuse rates."""
    stats = {True: [], False: []}
    for exit_head in (True, False):
        for text in CALIBRATION_PROMPTS:
            config = GenerationConfig(mode="mirror", gamma=gamma, max_new_tokens=tokens, exit_head=exit_head,
                                      chat=bool(view.manifest.tokenizer.chat_template), do_sample=False)
            stats[exit_head].append(view.generate(text, config).stats)
            tick()
    steps = sum(s.steps for s in stats[True])
    accepted = sum(s.accepted for s in stats[True])
    mean = (accepted + steps) / steps if steps else 1.0

    def reuse(runs) -> float:
        windows = sum(s.windows for s in runs)
        return sum(s.reused for s in runs) / windows if windows else 0.0

    acceptance = Acceptance(alpha_from_mean_accepted(mean, gamma), reuse(stats[True]), reuse(stats[False]),
                            "calibration", stops=calibrate_stops(view, MAX_GAMMA, tokens, tick))
    steps = {e: (sum(s.seconds - s.time_to_first_token_s for s in runs) / max(sum(s.steps for s in runs), 1))
             for e, runs in stats.items()}  # measured decode seconds per step, with / without the exit head
    return acceptance, {"gamma": gamma, "prompts": len(CALIBRATION_PROMPTS), "tokens": tokens,
                        "mean_accepted_tokens": round(mean, 4), "mirror_step_s": [steps[True], steps[False]]}


def calibrate_stops(view: PipelineView, gamma: int = MAX_GAMMA, tokens: int = CALIBRATION_TOKENS,
                    tick=lambda: None) -> tuple[StopCounts, ...]:
    """sd at window ``gamma`` on the calibration prompts, every pick's draft probability recorded: the replayed
    draft-confidence stops (planner/stops.py) that mode auto ranks before a generation has measured its own."""
    from mirrorsd.runtime.decoder import DecodeSettings, decode
    from mirrorsd.runtime.proposers import SerialDraft

    replay = StopReplay(gamma)
    manifest = view.manifest
    config = GenerationConfig(chat=bool(manifest.tokenizer.chat_template))
    limit = min(manifest.target.max_position_embeddings, manifest.draft.max_position_embeddings)
    settings = DecodeSettings(tokens, tuple(manifest.tokenizer.eos_token_ids), limit, gamma)
    for text in CALIBRATION_PROMPTS:
        proposer = SerialDraft(view.draft)
        proposer.record_stops(replay)
        decode(view.target, proposer, view.encode(text, config), settings)
        tick()
    return replay.counts()


def fit_mirror_host(costs: SplitCosts, acceptance: Acceptance, how: dict) -> SplitCosts:
    """``costs`` with mirror_host_s fitted: the calibration's measured Mirror-SD step minus the model's (>= 0)."""
    from dataclasses import replace

    from mirrorsd.runtime.planner.latency import mirror_step

    gamma = how["gamma"]
    extra = tuple(max(0.0, measured - mirror_step(costs, gamma, exit_head, acceptance.reuse_for(exit_head),
                                                   gamma * costs.draft1_s))
                  for measured, exit_head in zip(how["mirror_step_s"], (True, False)))
    return replace(costs, mirror_host_s=extra)


def profile_for(view: PipelineView, progress: bool = False, refresh: bool = False) -> profiles.Profile:
    """The profile of ``view``'s export and device set, from the cache; what the cache lacks (this thread split,
    the acceptance) is measured now and cached."""
    from tqdm import tqdm

    placement = dict(view.placement)
    devices = dict(view.devices)  # what reopens this placement (mode auto ranks placements by it)
    path = profiles.cache_path(view.folder, placement)
    current = None if refresh else cached(path)
    if current is None:
        current = profiles.Profile(kind="measured", machine=machine_words(), splits=(),
                                   export={"folder": str(view.folder), "placement": placement, "devices": devices},
                                   created=profiles.now())
    known = current.split(*view.thread_key)
    doubt = contradiction(known) if known is not None else ""
    if doubt:
        profiles.skipped(path, profiles.ProfileError("its costs contradict each other", doubt))
    need_split = known is None or bool(doubt)
    # an acceptance calibrated on another prompt set (an older mirrorsd) is measured again
    need_acceptance = (current.acceptance is None
                       or current.calibration.get("prompts") != len(CALIBRATION_PROMPTS)
                       or (current.acceptance.source == "calibration" and not current.acceptance.stops))
    #                  (an older mirrorsd calibrated no draft-confidence stops; a hand-set acceptance stays as set)
    if not (need_split or need_acceptance or current.export.get("devices") != devices):
        return current
    current = profiles.Profile(**{**current.__dict__, "export": {**current.export, "devices": devices}})
    steps = (REPEATS + 5 if need_split else 0) + (3 * len(CALIBRATION_PROMPTS) if need_acceptance else 0)
    bar = tqdm(total=steps, disable=not progress,
               desc=f"profiling {split_name(*view.thread_key)} threads", unit="step")
    try:
        if need_split:
            costs, detail = measure_split(view, tick=lambda: bar.update(1))
            if contradiction(costs):  # measured while something else ran: once more (then auto corrects it
                costs, detail = measure_split(view)  # online from the step times it measures while generating)
            current = current.with_split(costs, detail)
        if need_acceptance:
            acceptance, how = calibrate(view, tick=lambda: bar.update(1))
            current = profiles.Profile(**{**current.__dict__, "acceptance": acceptance, "calibration": how})
            costs = current.split(*view.thread_key)  # the calibrated split: fit Mirror-SD's host time on it
            index = current.splits.index(costs)
            current = current.with_split(fit_mirror_host(costs, acceptance, how), current.detail[index])
    finally:
        bar.close()
    profiles.save_or_say(current, path)  # a read-only cache: this run uses it from memory
    return current


WIDTH_TOLERANCE = 2.0  # a verify of fewer rows may measure this much dearer than one of more rows (noise); beyond
#                        it, the profile was taken while something else ran (a 1-row step cannot cost more than 2)
WIDTH_SLACK_S = 1e-3  # ... and by this much in seconds: tiny models' steps are overhead, noisy on a shared machine


def contradiction(costs: SplitCosts) -> str:
    """Why ``costs`` contradict themselves, or "": a verify (or exit) step of fewer rows measured dearer than one
    of more rows by more than WIDTH_TOLERANCE and WIDTH_SLACK_S (the rows run in one batch: more never cost less)."""
    for name in ("verify_s", "exit_s"):
        times = getattr(costs, name)
        for rows in range(len(times) - 1):
            wider = min(times[rows + 1:])
            if wider > 0 and times[rows] > WIDTH_TOLERANCE * wider and times[rows] - wider > WIDTH_SLACK_S:
                return (f"{name}: {rows + 1} row(s) {times[rows] * 1e3:.2f} ms against "
                        f"{wider * 1e3:.2f} ms for more rows")
    return ""


def cached(path) -> profiles.Profile | None:
    """The profile cached at ``path``, or None: none there, or an unusable entry (garbage, a folder, a FIFO, an
    endless file, another schema; said in one line), which is measured again."""
    import os

    if profiles.unsaved(path) is not None:  # measured by this process, its cache read-only
        return profiles.unsaved(path)
    if not os.path.lexists(path):
        return None
    try:
        return profiles.load(path)
    except profiles.ProfileError as exc:
        profiles.skipped(path, exc)
        return None


def machine_words() -> str:
    import os
    import platform

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
