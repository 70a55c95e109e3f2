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

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from mirrorsd import names
from mirrorsd.errors import GenerationInputError, ManifestError
from mirrorsd.manifest import Manifest, load_manifest
from mirrorsd.runtime import limits
from mirrorsd.runtime.config import AUTO, GenerationConfig
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.mirror import MirrorProposer
from mirrorsd.runtime.models import TargetModel
from mirrorsd.runtime.ngram import NgramIndex, NgramProposer, NgramSettings
from mirrorsd.runtime.one_at_a_time import OneAtATime
from mirrorsd.runtime.open_graphs import open_sessions
from mirrorsd.runtime.planner import loading
from mirrorsd.runtime.planner.auto import AutoProposer
from mirrorsd.runtime.planner.planner import Planner
from mirrorsd.runtime.planner.threads import default as default_choice
from mirrorsd.runtime.planner.view import PipelineView
from mirrorsd.runtime.proposers import SerialDraft, TargetOnly
from mirrorsd.runtime.sampling import Sampler, SamplingParams
from mirrorsd.runtime.session import GraphSession
from mirrorsd.runtime.static_cache import StaticDraftModel, draft_model
from mirrorsd.runtime.streaming import streaming_draft
from mirrorsd.runtime.stats import GenerationResult, summarize
from mirrorsd.runtime.text import StreamDecoder, TextCodec
from mirrorsd.user_files import resolved


class Pipeline:
    """Sessions for every graph of an export folder, and the decoders on top of them: load once (with the placement
    and threads mode auto's planner chose, runtime/planner/loading.py), plan, decode, learn (planner.Planner)."""

    def __init__(self, folder: Path, manifest: Manifest, sessions: dict[str, GraphSession], placements: dict,
                 threads: tuple[int, int] = (1, 1), planner: Planner | None = None) -> None:
        self.folder, self.manifest, self.sessions, self.placements = folder, manifest, sessions, placements
        self.threads = threads  # intra-op threads of the target's and the draft's sessions
        self.codec = TextCodec(folder, manifest)
        self.target = TargetModel(sessions[names.PREFIX], sessions[names.EXIT_HEAD], sessions[names.SUFFIX],
                                  exit_sparse=sessions.get(names.EXIT_SPARSE))
        self.draft = draft_model(sessions[names.DRAFT])  # StaticDraftModel when placed on the static graph
        self.streaming_draft = streaming_draft(sessions)  # None unless the export has a streaming draft
        self._mirror: MirrorProposer | None = None
        self._one_at_a_time = OneAtATime()  # one generation at a time: calls from two threads serialize
        self.target_timeline = sessions[names.PREFIX].timeline
        self.draft_timeline = sessions[names.DRAFT].timeline
        unplanned = "threads not planned (DeviceRequest.plan_from_profile off)"
        self.planner = planner or Planner(default_choice(threads, unplanned, self.shared_pool))

    @classmethod
    def load(cls, folder: str | os.PathLike, devices=None) -> "Pipeline":
        """Open every graph of export ``folder`` as ``devices`` asks, once. With ``devices.plan_from_profile`` the
        placement and thread split are the ones the cached profiles predict fastest, chosen before any session
        opens (runtime/planner/loading.py)."""
        folder = resolved(folder, "the export folder", ManifestError)
        manifest = load_manifest(folder)
        devices = loading.device_request(devices)
        limits.check_threads(devices)
        limits.check_vocabularies(manifest)
        chosen = loading.before_opening(folder, manifest, devices)
        pipe = cls(folder, manifest, *open_sessions(folder, manifest, chosen.request, chosen.threads, chosen.plan),
                   chosen.threads, Planner(chosen.thread_choice, chosen.placement_choice))
        if chosen.confirm:  # where the chain's pick runs is known now that it is open: choose, reopen if it loses
            request, choice = loading.planned_request(folder, manifest, devices, pipe.here())
            if request is not None:
                pipe.close()
                threads = choice.threads.threads
                pipe = cls(folder, manifest, *open_sessions(folder, manifest, request, threads), threads)
            pipe.planner.thread_choice, pipe.planner.placement_choice = choice.threads, choice
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

    def here(self) -> loading.Here:
        """This pipeline's placement as mode auto's choice sees it: devices, thread split, cached profile."""
        devices = self.device_strings()
        return loading.Here((devices["target"], devices["draft"]), self.thread_key,
                            loading.cached_profile(self.folder, self.placement))

    @property
    def placement(self) -> dict[str, str]:
        """Graph role -> where it runs (Placement.describe()): what the profile cache keys on."""
        return {role: p.describe() for role, p in self.placements.items()}

    def planner_view(self) -> PipelineView:
        """What mode auto's planner reads of this pipeline (profiling, the proposer)."""
        return PipelineView(self.folder, self.manifest, self.target, self.draft, self.streaming_draft,
                            self.target_timeline, self.draft_timeline, self.placement, self.device_strings(),
                            self.threads, self.shared_pool, self.encode, self.generate)

    @property
    def context_limit(self) -> int:
        return min(self.manifest.target.max_position_embeddings, self.manifest.draft.max_position_embeddings)

    def encode(self, prompt: str | list[int], config: GenerationConfig) -> list[int]:
        if isinstance(prompt, str):
            return self.codec.encode(prompt, chat=config.chat, system=config.system)
        return limits.prompt_ids(prompt, self.manifest.target.vocab_size)

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
        limits.check_prompt(ids, self.context_limit)
        inexact = self.inexact_windows() if config.mode != "ar" else ""
        if config.mode == AUTO and inexact:
            config = replace(config, mode="ar")  # the only exact mode here; auto never trades exactness for speed
        widest = config
        if config.mode == AUTO:  # checked as the widest strategy auto may pick; measured before the lock
            self.profile(progress=False)
            widest = replace(config, mode="mirror",
                             gamma=max(config.gamma, self.planner.costs(self.thread_key).max_gamma))
        limits.check_generation(widest, self.manifest, len(ids), self.context_limit)
        limits.check_exact(config.mode, inexact)
        if widest.mode != "ar" and isinstance(self.draft, StaticDraftModel):
            self.draft.check_room(len(ids) + config.max_new_tokens, widest.gamma)
        with self._one_at_a_time("generate"):
            return self._generate(ids, config, on_text, sampling)

    def inexact_windows(self) -> str:
        """Why a verification window's rows would not be bitwise the rows ar decodes, or "" (the usual case;
        devices/ort_kernel_check.inexact_windows)."""
        from mirrorsd.devices.ort_kernel_check import inexact_windows

        return inexact_windows(self.manifest, self.placements)

    def sampling(self, config: GenerationConfig) -> SamplingParams:
        """The sampling settings ``config`` resolves to: its values, else this export's defaults, else transformers'."""
        return SamplingParams.resolve(
            self.manifest.generation_defaults, config.seed, config.verify, do_sample=config.do_sample,
            temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
            repetition_penalty=config.repetition_penalty)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Target-only greedy decoding of several token-id prompts in one left-padded batch (``max_new_tokens``
        None: GenerationConfig's default)."""
        from mirrorsd.runtime.batch import check_batch, generate_batch

        max_new_tokens = GenerationConfig().max_new_tokens if max_new_tokens is None else max_new_tokens
        check_batch(prompts, max_new_tokens)
        ids = [self.encode(p, GenerationConfig()) for p in prompts]
        check_batch(ids, max_new_tokens, self.context_limit)
        pad = self.manifest.tokenizer.pad_token_id
        with self._one_at_a_time("generate_batch"):
            return generate_batch(self.target, ids, max_new_tokens, self.manifest.tokenizer.eos_token_ids,
                                  pad if pad is not None else 0)

    def profile(self, progress: bool = False, refresh: bool = False):
        """This export's profile on this device set and thread split (runtime/planner/profile.py): from the cache,
        else measured now (seconds to a minute) and cached. Mode auto plans from it."""
        return self.planner.profile(self.planner_view(), progress, refresh)

    def use_profile(self, profile) -> None:
        """Plan mode auto from ``profile`` (holding a split with this pipeline's threads) instead of the measured
        one: a what-if, or a test that fixes the costs and keeps the measured acceptance."""
        self.planner.use_profile(profile, self.thread_key)

    def _generate(self, ids: list[int], config: GenerationConfig, on_text, sampling: SamplingParams
                  ) -> GenerationResult:
        if config.mode == AUTO:
            proposer = self.planner.proposer(self.planner_view(), config, len(ids), self._proposer)
        else:
            proposer = self._proposer(config)
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
            auto = self.planner.learn(proposer)  # the next generation plans from this one's acceptance too
        stats = summarize(config.mode, outcome.counters, len(ids), len(outcome.tokens), outcome.seconds,
                          outcome.time_to_first_token_s, list(self.target_timeline.intervals),
                          list(self.draft_timeline.intervals), self.placement, outcome.finish_reason, auto)
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
            return SerialDraft(draft, lookahead, NgramIndex(lookup) if config.ngram else None,
                               config.draft_confidence or None)
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

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
