"""The public Python API: load an export folder once, generate with ``auto`` (the default), ``ar``, ``sd`` or ``mirror``.

    with Pipeline.load("exports/smollm2") as pipe:
        result = pipe.generate("Write a haiku about caches")  # auto: the fastest mode predicted here
        print(result.stats.auto["why"])
        result = pipe.generate("Write a haiku about caches", GenerationConfig(mode="mirror"))
        print(result.text, result.stats.tokens_per_second)
        sampled = pipe.generate("Write a haiku", GenerationConfig(do_sample=True, temperature=0.7, seed=1),
                                on_text=lambda piece: print(piece, end=""))  # streamed; same seed = same text
"""
from __future__ import annotations

import contextlib
import operator
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from mirrorsd import names
from mirrorsd.errors import DeviceError, GenerationInputError, ManifestError
from mirrorsd.manifest import Manifest, load_manifest
from mirrorsd.runtime import limits
from mirrorsd.runtime.planner import threads as auto_threads
from mirrorsd.runtime.planner.ar_probe import ArProbe
from mirrorsd.runtime.planner.auto import AutoProposer, blend, running_weight
from mirrorsd.runtime.config import AUTO, GenerationConfig
from mirrorsd.runtime.planner.latency import Strategy, split_name
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.mirror import MirrorProposer
from mirrorsd.runtime.models import TargetModel
from mirrorsd.runtime.ngram import NgramIndex, NgramProposer, NgramSettings
from mirrorsd.runtime.proposers import SerialDraft, TargetOnly
from mirrorsd.runtime.sampling import Sampler, SamplingParams
from mirrorsd.user_files import resolved
from mirrorsd.runtime.session import GraphSession, Timeline, graph_path
from mirrorsd.runtime.static_cache import StaticDraftModel, draft_model
from mirrorsd.runtime.streaming import streaming_draft
from mirrorsd.runtime.stats import GenerationStats, summarize
from mirrorsd.runtime.text import StreamDecoder, TextCodec

@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: list[int]
    stats: GenerationStats
    margins: list[float] = field(default_factory=list)
    sampling: SamplingParams = SamplingParams()  # what was used, seed included: pass it back to repeat the run

    @property
    def finish_reason(self) -> str:
        """Why generation stopped: "eos" (an EOS token), "length" (max_new_tokens) or "context" (the context limit)."""
        return self.stats.finish_reason


class Pipeline:
    """Sessions for every graph of an export folder, and the three decoders on top of them."""

    def __init__(self, folder: Path, manifest: Manifest, sessions: dict[str, GraphSession], placements: dict,
                 threads: tuple[int, int] = (1, 1)) -> None:
        self.folder, self.manifest, self.sessions, self.placements = folder, manifest, sessions, placements
        self.threads = threads  # intra-op threads of the target's and the draft's sessions
        self.codec = TextCodec(folder, manifest)
        self.target = TargetModel(sessions[names.PREFIX], sessions[names.EXIT_HEAD], sessions[names.SUFFIX],
                                  exit_sparse=sessions.get(names.EXIT_SPARSE))
        self.draft = draft_model(sessions[names.DRAFT])  # StaticDraftModel when placed on the static graph
        self.streaming_draft = streaming_draft(sessions)  # None unless the export has a streaming draft
        self._mirror: MirrorProposer | None = None
        self._lock = threading.Lock()  # one generation at a time per pipeline: calls from two threads serialize
        self._owner: int | None = None  # the thread holding _lock (a call back into the pipeline is refused)
        self.target_timeline = sessions[names.PREFIX].timeline
        self.draft_timeline = sessions[names.DRAFT].timeline
        self._profile = None  # mode auto: this export's measured profile (runtime/planner/profiling.py), loaded once
        self._acceptance = None  # mode auto: the acceptance the last generations measured (else the profile's)
        self._measured_generations = 0  # mode auto: generations whose acceptance went into _acceptance
        self.thread_choice = auto_threads.default(threads, "threads not planned (DeviceRequest.plan_from_profile off)",
                                                  self.shared_pool)
        self.placement_choice = None  # mode auto: the PlacementChoice it was loaded with (plan_from_profile)

    @classmethod
    def load(cls, folder: str | os.PathLike, devices=None) -> "Pipeline":
        """Open every graph of export ``folder`` as ``devices`` asks. With ``devices.plan_from_profile`` and no threads
        given, the sessions get the thread split the cached profile predicts fastest (runtime/planner/threads.py):
        they open with the default, and reopen when the profile says another split (a second load)."""
        from mirrorsd.devices.backends import default_threads
        from mirrorsd.devices.placement import DeviceRequest

        folder = resolved(folder, "the export folder", ManifestError)
        manifest = load_manifest(folder)
        if isinstance(devices, str):  # one device string for both models, as the CLI's --device flags take it
            devices = DeviceRequest(target=devices, draft=devices)
        devices = devices or DeviceRequest()
        if not isinstance(devices, DeviceRequest):
            raise DeviceError(f"devices must be a DeviceRequest or a device string, not {type(devices).__name__}",
                              "it says where each model runs", "pass DeviceRequest(target=..., draft=...), 'cpu', "
                                                               "or None (auto placement)")
        limits.check_threads(devices)
        limits.check_vocabularies(manifest)
        threads = (devices.target_threads or default_threads(), devices.draft_threads or default_threads())
        pipe = cls(folder, manifest, *cls._open(folder, manifest, devices, threads), threads)
        if devices.target_threads or devices.draft_threads:
            pipe.thread_choice = auto_threads.given(threads, pipe.shared_pool)
        if devices.plan_from_profile:
            request, choice = pipe.planned_request(devices)
            if request is not None:
                pipe.close()
                pipe = cls(folder, manifest, *cls._open(folder, manifest, request, choice.threads.threads),
                           choice.threads.threads)
            pipe.thread_choice, pipe.placement_choice = choice.threads, choice
        return pipe

    def device_strings(self) -> dict[str, str]:
        """The device string each model runs on ({"target": "cpu", "draft": "openvino:CPU"}): what reopens it."""
        return {p.model: p.device for p in self.placements.values()}

    @property
    def shared_pool(self) -> bool:
        """Whether this pipeline's ONNX Runtime CPU sessions run on the process's shared pool."""
        return any(p.shared_pool for p in self.placements.values())

    @property
    def thread_key(self) -> tuple[int, int, bool]:
        """(target threads, draft threads, shared pool): the split of a profile this pipeline runs."""
        return (*self.threads, self.shared_pool)

    @property
    def device_pair(self) -> tuple[str, str]:
        """(target, draft) device strings: this pipeline's placement as mode auto ranks placements."""
        here = self.device_strings()
        return here["target"], here["draft"]

    def placement_profiles(self, devices) -> dict:
        """(target, draft) device pair -> its cached profile or None, for every pair ``devices`` allows here (this
        pipeline's own pair first); nothing is measured."""
        from mirrorsd.runtime.planner import profile as profiles
        from mirrorsd.devices.placement import placement_candidates

        cached = profiles.cached_by_devices(self.folder)
        found = {pair: cached.get(pair) for pair in placement_candidates(self.manifest, devices)}
        found[self.device_pair] = self.cached_profile()  # by this placement's path (older profiles lack "devices")
        return found

    def planned_request(self, devices, found: dict | None = None):
        """(the DeviceRequest to reopen with, or None to keep this pipeline; the PlacementChoice): the placement
        and thread split the cached profiles of this export (``found``: placement_profiles) predict fastest
        (runtime/planner/placement.py), among the devices ``devices`` allows here; nothing is measured."""
        from mirrorsd.devices import thread_pool
        from mirrorsd.runtime.planner.placement import choose_placement
        from mirrorsd.runtime.planner.threads import SplitRule

        found = self.placement_profiles(devices) if found is None else found
        chain_pick = self.device_pair
        given = bool(devices.target_threads or devices.draft_threads)
        rule = SplitRule(self.threads if given else None, devices.shared_pool, thread_pool.shared_size())
        choice = choose_placement(found, chain_pick, self.thread_key, rule)
        if choice.devices == chain_pick and choice.threads.key == self.thread_key:
            return None, choice
        target_threads, draft_threads = choice.threads.threads
        return replace(devices, target=choice.devices[0], draft=choice.devices[1], target_threads=target_threads,
                       draft_threads=draft_threads, shared_pool=choice.threads.shared_pool), choice

    @staticmethod
    def _open(folder: Path, manifest: Manifest, devices, threads: tuple[int, int]) -> tuple[dict, dict]:
        """(sessions, placements) of every graph, with ``threads`` intra-op threads (target, draft)."""
        from mirrorsd.devices import thread_pool
        from mirrorsd.devices.placement import open_graph, plan_placement

        timelines = {"target": Timeline(), "draft": Timeline()}
        sessions, placements = {}, {}
        plan = plan_placement(manifest, devices)  # decided once for both models; warns when auto fell back
        devices = replace(devices, shared_pool=thread_pool.resolve(devices.shared_pool, threads,
                                                                   thread_pool.shared_size()))
        for role in names.GRAPH_ROLES:
            spec = manifest.graph(plan.graph_role(role))  # the draft may be served by draft_static
            backend, placement = open_graph(graph_path(folder, spec), spec.model, devices,
                                            threads[0] if spec.model == "target" else threads[1],
                                            plan.decision(spec.model), spec.kv, plan.kernels)
            sessions[role] = GraphSession(spec, backend, placement, timelines[spec.model])
            placements[role] = placement
        if names.DRAFT_STREAMING in manifest.graphs and not plan.decision("draft").static:
            spec = manifest.graph(names.DRAFT_STREAMING)  # beside the draft: same device, same KV cache
            backend, placement = open_graph(graph_path(folder, spec), spec.model, devices,
                                            threads[1], plan.decision("draft"),
                                            kernels=plan.kernels)
            sessions[spec.role] = GraphSession(spec, backend, placement, timelines["draft"])
            placements[spec.role] = placement
        if names.EXIT_SPARSE in manifest.graphs:  # beside the exit head, on the target's device
            spec = manifest.graph(names.EXIT_SPARSE)
            backend, placement = open_graph(graph_path(folder, spec), spec.model, devices, threads[0],
                                            plan.decision("target"), kernels=plan.kernels)
            sessions[spec.role] = GraphSession(spec, backend, placement, timelines["target"])
            placements[spec.role] = placement
        return sessions, placements

    def cached_profile(self):
        """The cached profile of this export and placement, or None (none yet, or unreadable: measured again)."""
        from mirrorsd.runtime.planner import profile as profiles
        from mirrorsd.runtime.planner.profiling import cached

        return cached(profiles.cache_path(self.folder, {role: p.describe() for role, p in self.placements.items()}))

    @property
    def context_limit(self) -> int:
        return min(self.manifest.target.max_position_embeddings, self.manifest.draft.max_position_embeddings)

    def encode(self, prompt: str | list[int], config: GenerationConfig) -> list[int]:
        if isinstance(prompt, str):
            return self.codec.encode(prompt, chat=config.chat, system=config.system)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise GenerationInputError("The prompt is bytes", "a prompt is text (str) or a list of token ids",
                                       "decode it first, e.g. prompt.decode('utf-8')")
        try:
            ids = [operator.index(t) for t in prompt]  # ints and NumPy ints; not floats, strings or lists
        except TypeError:
            raise GenerationInputError("Prompt ids must be integers", f"the prompt holds {prompt!r:.80}",
                                       "pass text, or token ids from this export's tokenizer") from None
        vocab = self.manifest.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise GenerationInputError("Prompt ids out of range", f"ids must be in 0..{vocab - 1}",
                                       "encode text with this export's tokenizer")
        return ids

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Generate (greedy or sampled, see ``sampling``); ``on_text`` receives text pieces as tokens are committed.
        ``config`` None means the defaults."""
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise GenerationInputError(f"config must be a GenerationConfig, not {type(config).__name__}",
                                       "it holds the decoding settings", "pass GenerationConfig(...) or None")
        config.check()
        sampling = self.sampling(config)
        ids = self.encode(prompt, config)
        if not ids:
            raise GenerationInputError("The prompt is empty", "there is nothing to continue", "pass some text")
        if len(ids) + 1 > self.context_limit:
            raise GenerationInputError(
                f"The prompt has {len(ids)} tokens", f"the exported graphs allow {self.context_limit} in all",
                "shorten the prompt")
        inexact = self.inexact_windows() if config.mode != "ar" else ""
        if config.mode == AUTO and inexact:
            config = replace(config, mode="ar")  # the only exact mode here; auto never trades exactness for speed
        widest = config
        if config.mode == AUTO:  # checked as the widest strategy auto may pick; measured before the lock
            self.profile(progress=False)
            widest = replace(config, mode="mirror", gamma=max(config.gamma, self._profile_costs().max_gamma))
        limits.check_generation(widest, self.manifest, len(ids), self.context_limit)
        if config.mode != "ar" and inexact:
            raise GenerationInputError(
                f"--mode {config.mode} would not reproduce target-only decoding here", inexact,
                "pass --kernels mirrorsd or auto (mirrorsd's kernels need a C++ compiler: bash scripts/setup.sh "
                "installs one), or use --mode ar")
        if widest.mode != "ar" and isinstance(self.draft, StaticDraftModel):
            self.draft.check_room(len(ids) + config.max_new_tokens, widest.gamma)
        with self._one_at_a_time("generate"):
            return self._generate(ids, config, on_text, sampling)

    def inexact_windows(self) -> str:
        """Why a verification window's rows would not be bitwise the rows ar decodes, or "" (the usual case): only a
        target with int8 activations (a quantized grouped-attention export) run by ONNX Runtime's own CPU kernel on
        a CPU where that kernel's one-row path differs from its several-row path (devices/ort_kernel_check.py)."""
        precision = self.manifest.export_options.get("target_precision")
        if self.manifest.attention != "grouped" or precision not in ("int4", "int8"):
            return ""
        ort_kernel = [p for role, p in self.placements.items() if p.model == "target" and p.backend == "onnxruntime"
                      and "CPU" in p.effective and p.kernels != "mirrorsd"]
        if not ort_kernel:
            return ""
        from mirrorsd.devices.ort_kernel_check import ort_int8_kernel_difference

        difference = ort_int8_kernel_difference()
        if difference == 0.0:
            return ""
        return (f"the {precision} target runs ONNX Runtime's MatMulNBits kernel with int8 activations, whose one-row "
                f"path differs from its several-row path on this CPU (by {difference:.1e} per layer, measured "
                f"at load), so verification windows drift from one-row decoding")

    def sampling(self, config: GenerationConfig) -> SamplingParams:
        """The sampling settings ``config`` resolves to: its values, else this export's defaults, else transformers'."""
        return SamplingParams.resolve(
            self.manifest.generation_defaults, config.seed, config.verify, do_sample=config.do_sample,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            repetition_penalty=config.repetition_penalty)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Target-only greedy decoding of several token-id prompts in one left-padded batch (``max_new_tokens``
        None: GenerationConfig's default)."""
        from mirrorsd.runtime.batch import generate_batch

        max_new_tokens = GenerationConfig().max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise GenerationInputError(f"max_new_tokens must be an int, not {type(max_new_tokens).__name__}",
                                       "it counts the tokens to generate", "pass an int >= 1, or None")
        if not prompts or any(not p for p in prompts) or max_new_tokens < 1:
            raise GenerationInputError("generate_batch needs non-empty prompts and max_new_tokens >= 1",
                                       "there is nothing to generate", "check the arguments")
        ids = [self.encode(p, GenerationConfig()) for p in prompts]
        if max(len(p) for p in ids) + max_new_tokens > self.context_limit:
            raise GenerationInputError("A prompt plus max_new_tokens exceeds the context",
                                       f"the exported graphs allow {self.context_limit} tokens", "shorten it")
        pad = self.manifest.tokenizer.pad_token_id
        with self._one_at_a_time("generate_batch"):
            return generate_batch(self.target, ids, max_new_tokens, self.manifest.tokenizer.eos_token_ids,
                                  pad if pad is not None else 0)

    def profile(self, progress: bool = False, refresh: bool = False):
        """This export's profile on this device set and thread split (runtime/planner/profile.py): from the cache, else
        measured now (seconds to a minute) and cached. Mode auto plans from it."""
        from mirrorsd.runtime.planner.profiling import profile_for

        if self._profile is None or refresh or self._profile.split(*self.thread_key) is None:
            self._profile = profile_for(self, progress, refresh)
        return self._profile

    def use_profile(self, profile) -> None:
        """Plan mode auto from ``profile`` (a runtime/planner/profile.py Profile holding a split with this pipeline's
        threads) instead of the measured one: a what-if, or a test that fixes the costs and keeps the measured
        acceptance."""
        if profile.split(*self.thread_key) is None:
            from mirrorsd.errors import ProfileError

            raise ProfileError("The profile has no split with this pipeline's threads",
                               f"the pipeline runs {split_name(*self.thread_key)} threads",
                               "add that split, or load the pipeline with matching threads")
        self._profile = profile

    def _profile_costs(self):
        return self._profile.split(*self.thread_key)

    def auto_proposer(self, config: GenerationConfig, prompt_tokens: int = 0) -> AutoProposer:
        """The proposer of mode auto: plans from the profile and the acceptance measured so far, for a generation
        of ``config.max_new_tokens`` after ``prompt_tokens``."""
        profile = self.profile()
        prior = self._acceptance or profile.acceptance
        streaming = config.streaming and self.streaming_draft is not None
        probe = None if streaming else ArProbe(self.draft)  # (a streaming draft's acceptance is another one)
        return AutoProposer(lambda strategy: self._proposer(self.concrete(config, strategy)), self._profile_costs(),
                            prior, streaming, context=prompt_tokens, new_tokens=config.max_new_tokens, probe=probe)

    @staticmethod
    def concrete(config: GenerationConfig, strategy: Strategy) -> GenerationConfig:
        """The fixed-mode config that runs ``strategy`` with ``config``'s other settings."""
        return replace(config, mode=strategy.mode, gamma=max(strategy.gamma, 1), exit_head=strategy.exit_head,
                       streaming=strategy.streaming)

    def _generate(self, ids: list[int], config: GenerationConfig, on_text, sampling: SamplingParams
                  ) -> GenerationResult:
        proposer = self.auto_proposer(config, len(ids)) if config.mode == AUTO else self._proposer(config)
        gamma = proposer.costs.max_gamma if config.mode == AUTO else config.gamma
        settings = DecodeSettings(config.max_new_tokens, self.manifest.tokenizer.eos_token_ids, self.context_limit,
                                  0 if config.mode == "ar" else gamma, config.record_margins,
                                  config.on_draft_failure, Sampler(sampling))
        stream = StreamDecoder(self.codec) if on_text else None
        emit = (lambda new: on_text(stream.push(new))) if stream else (lambda new: None)
        self.target_timeline.clear()
        self.draft_timeline.clear()
        outcome = decode(self.target, proposer, ids, settings, emit)
        auto = {}
        if isinstance(proposer, MirrorProposer):
            outcome.counters.branches_rolled_out = proposer.counters.branches
        elif isinstance(proposer, AutoProposer):
            outcome.counters.branches_rolled_out = proposer.branches
            # the next generation plans from this one's acceptance, in a running mean with what was known
            online = proposer.measured_acceptance()
            if online.source == "online":
                self._measured_generations += 1
            weight = running_weight(self._measured_generations, self._profile.calibration.get("prompts", 1))
            self._acceptance = blend(proposer.prior, online, weight)
            auto = {**proposer.report(), "threads": self.thread_choice.to_dict(),
                    "placement": None if self.placement_choice is None else self.placement_choice.to_dict()}
        placement = {role: p.describe() for role, p in self.placements.items()}
        stats = summarize(config.mode, outcome.counters, len(ids), len(outcome.tokens), outcome.seconds,
                          outcome.time_to_first_token_s, list(self.target_timeline.intervals),
                          list(self.draft_timeline.intervals), placement, outcome.finish_reason, auto)
        return GenerationResult(outcome.tokens, self.codec.decode(outcome.tokens), ids, stats, outcome.margins,
                                sampling)

    def _proposer(self, config: GenerationConfig):
        if config.mode == "ar":
            return TargetOnly()
        lookup = NgramSettings(config.ngram_min, config.ngram_max)
        if config.mode == "ngram":
            return NgramProposer(self.manifest.target.vocab_size, lookup)
        streaming = self.streaming_draft if config.streaming else None
        draft, lookahead = (streaming, True) if streaming else (self.draft, False)  # the streams are lookahead
        if config.mode == "sd":
            return SerialDraft(draft, lookahead, NgramIndex(lookup) if config.ngram else None)
        settings, guesses = config.mirror, lookup if config.ngram else None
        if self._mirror is None or (self._mirror.settings, self._mirror.lookup) != (settings, guesses) or \
                self._mirror.draft is not draft:
            if self._mirror is not None:
                self._mirror.close()
            self._mirror = MirrorProposer(draft, settings, lookahead, guesses)
        return self._mirror

    def close(self) -> None:
        with self._one_at_a_time("close"):
            if self._mirror is not None:
                self._mirror.close()
                self._mirror = None

    @contextlib.contextmanager
    def _one_at_a_time(self, call: str):
        """Hold the pipeline's lock; a call from inside this pipeline's own on_text callback (the thread that holds
        it) is an error instead of a deadlock."""
        if self._owner == threading.get_ident():
            raise GenerationInputError(f"Pipeline.{call} was called from inside the same pipeline's on_text callback",
                                       "the pipeline runs one generation at a time, and the one calling back is "
                                       "still running", f"collect the text and call {call} after generate returns "
                                                        "(or use another Pipeline)")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
