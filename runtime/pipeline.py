"""The public Python API: load an export folder once, generate with ``ar``, ``sd`` or ``mirror``.

    with Pipeline.load("exports/smollm2") as pipe:
        result = pipe.generate("Write a haiku about caches", GenerationConfig(mode="mirror"))
        print(result.text, result.stats.tokens_per_second)
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mirrorsd import names
from mirrorsd.errors import GenerationInputError
from mirrorsd.manifest import Manifest, load_manifest
from mirrorsd.runtime.decoder import DecodeSettings, decode
from mirrorsd.runtime.mirror import MirrorProposer, MirrorSettings
from mirrorsd.runtime.models import DraftModel, TargetModel
from mirrorsd.runtime.proposers import SerialDraft, TargetOnly
from mirrorsd.runtime.session import GraphSession, Timeline, graph_path
from mirrorsd.runtime.stats import GenerationStats, summarize
from mirrorsd.runtime.text import StreamDecoder, TextCodec

MODES = ("ar", "sd", "mirror")


@dataclass(frozen=True)
class GenerationConfig:
    """Knobs of one generation. Defaults: Mirror-SD, gamma 4, up to 4 branches per step in batches of 2."""

    mode: str = "mirror"
    max_new_tokens: int = 128
    gamma: int = 4  # draft window length (tokens proposed per step)
    branches: int = 4  # Mirror-SD: branches rolled out per step at most
    branch_batch: int = 2  # Mirror-SD: branches per batched draft rollout
    runner_up_k: int = 4  # Mirror-SD: the draft's own candidate tokens per position
    branch_budget: str = "time"  # Mirror-SD: "time" (until the verdict) or "cap" (always `branches`)
    chat: bool = True  # apply the chat template to a text prompt
    system: str | None = None
    record_margins: bool = False
    on_draft_failure: str = "raise"  # or "fallback": continue target-only, counted in statistics
    draft_timeout_s: float = 120.0

    def check(self) -> None:
        if self.mode not in MODES:
            raise GenerationInputError(f"Unknown mode '{self.mode}'", f"modes are {', '.join(MODES)}", "pick one")
        for name in ("max_new_tokens", "gamma", "branches", "branch_batch", "runner_up_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise GenerationInputError(f"{name} must be a positive integer, got {value!r}",
                                           "it counts tokens or branches", f"pass {name} >= 1")
        if self.branch_budget not in ("time", "cap"):
            raise GenerationInputError(f"branch_budget '{self.branch_budget}' is unknown",
                                       "it is 'time' or 'cap'", "pick one")
        if self.on_draft_failure not in ("raise", "fallback"):
            raise GenerationInputError(f"on_draft_failure '{self.on_draft_failure}' is unknown",
                                       "it is 'raise' or 'fallback'", "pick one")


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: list[int]
    stats: GenerationStats
    margins: list[float] = field(default_factory=list)


class Pipeline:
    """Sessions for every graph of an export folder, and the three decoders on top of them."""

    def __init__(self, folder: Path, manifest: Manifest, sessions: dict[str, GraphSession], placements: dict) -> None:
        self.folder, self.manifest, self.sessions, self.placements = folder, manifest, sessions, placements
        self.codec = TextCodec(folder, manifest)
        self.target = TargetModel(sessions[names.PREFIX], sessions[names.EXIT_HEAD], sessions[names.SUFFIX])
        self.draft = DraftModel(sessions[names.DRAFT])
        self._mirror: MirrorProposer | None = None
        self._lock = threading.Lock()  # one generation at a time per pipeline: calls from two threads serialize
        self.target_timeline = sessions[names.PREFIX].timeline
        self.draft_timeline = sessions[names.DRAFT].timeline

    @classmethod
    def load(cls, folder: str | os.PathLike, devices=None) -> "Pipeline":
        from mirrorsd.devices.backends import default_threads
        from mirrorsd.devices.placement import DeviceRequest, open_graph

        folder = Path(folder).expanduser().resolve()
        manifest = load_manifest(folder)
        devices = devices or DeviceRequest()
        timelines = {"target": Timeline(), "draft": Timeline()}
        sessions, placements = {}, {}
        for role in names.GRAPH_ROLES:
            spec = manifest.graph(role)
            threads = (devices.target_threads if spec.model == "target" else devices.draft_threads) \
                or default_threads(2)
            backend, placement = open_graph(graph_path(folder, spec), spec.model, devices, threads)
            sessions[role] = GraphSession(spec, backend, placement, timelines[spec.model])
            placements[role] = placement
        return cls(folder, manifest, sessions, placements)

    @property
    def context_limit(self) -> int:
        return min(self.manifest.target.max_position_embeddings, self.manifest.draft.max_position_embeddings)

    def encode(self, prompt: str | list[int], config: GenerationConfig) -> list[int]:
        if isinstance(prompt, str):
            return self.codec.encode(prompt, chat=config.chat, system=config.system)
        ids = [int(t) for t in prompt]
        vocab = self.manifest.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise GenerationInputError("Prompt ids out of range", f"ids must be in 0..{vocab - 1}",
                                       "encode text with this export's tokenizer")
        return ids

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        """Generate greedily; ``on_text`` receives text pieces as tokens are committed (streaming)."""
        config.check()
        ids = self.encode(prompt, config)
        if not ids:
            raise GenerationInputError("The prompt is empty", "there is nothing to continue", "pass some text")
        if len(ids) + 1 > self.context_limit:
            raise GenerationInputError(
                f"The prompt has {len(ids)} tokens", f"the exported graphs allow {self.context_limit} in all",
                "shorten the prompt")
        with self._lock:
            return self._generate(ids, config, on_text)

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Target-only greedy decoding of several token-id prompts in one left-padded batch."""
        from mirrorsd.runtime.batch import generate_batch

        if not prompts or any(not p for p in prompts) or max_new_tokens < 1:
            raise GenerationInputError("generate_batch needs non-empty prompts and max_new_tokens >= 1",
                                       "there is nothing to generate", "check the arguments")
        ids = [self.encode(p, GenerationConfig()) for p in prompts]
        if max(len(p) for p in ids) + max_new_tokens > self.context_limit:
            raise GenerationInputError("A prompt plus max_new_tokens exceeds the context",
                                       f"the exported graphs allow {self.context_limit} tokens", "shorten it")
        pad = self.manifest.tokenizer.pad_token_id
        with self._lock:
            return generate_batch(self.target, ids, max_new_tokens, self.manifest.tokenizer.eos_token_ids,
                                  pad if pad is not None else 0)

    def _generate(self, ids: list[int], config: GenerationConfig, on_text) -> GenerationResult:
        proposer = self._proposer(config)
        settings = DecodeSettings(config.max_new_tokens, self.manifest.tokenizer.eos_token_ids, self.context_limit,
                                  0 if config.mode == "ar" else config.gamma, config.record_margins,
                                  config.on_draft_failure)
        stream = StreamDecoder(self.codec) if on_text else None
        emit = (lambda new: on_text(stream.push(new))) if stream else (lambda new: None)
        self.target_timeline.clear()
        self.draft_timeline.clear()
        outcome = decode(self.target, proposer, ids, settings, emit)
        placement = {role: p.describe() for role, p in self.placements.items()}
        stats = summarize(config.mode, outcome.counters, len(ids), len(outcome.tokens), outcome.seconds,
                          outcome.time_to_first_token_s, list(self.target_timeline.intervals),
                          list(self.draft_timeline.intervals), placement)
        if isinstance(proposer, MirrorProposer):
            outcome.counters.branches_rolled_out = proposer.counters.branches
            stats = summarize(config.mode, outcome.counters, len(ids), len(outcome.tokens), outcome.seconds,
                              outcome.time_to_first_token_s, list(self.target_timeline.intervals),
                              list(self.draft_timeline.intervals), placement)
        return GenerationResult(outcome.tokens, self.codec.decode(outcome.tokens), ids, stats, outcome.margins)

    def _proposer(self, config: GenerationConfig):
        if config.mode == "ar":
            return TargetOnly()
        if config.mode == "sd":
            return SerialDraft(self.draft)
        settings = MirrorSettings(config.branches, config.branch_batch, config.runner_up_k, config.draft_timeout_s,
                                  config.branch_budget)
        if self._mirror is None or self._mirror.settings != settings:
            if self._mirror is not None:
                self._mirror.close()
            self._mirror = MirrorProposer(self.draft, settings)
        return self._mirror

    def close(self) -> None:
        with self._lock:
            if self._mirror is not None:
                self._mirror.close()
                self._mirror = None

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
