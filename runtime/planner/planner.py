"""Mode auto's state for one loaded pipeline: the profile it plans from, the acceptance learned from generations,
and the placement and thread split chosen before the sessions opened (choice.py).

    plan    profile(): this export's profile on the pipeline's placement and split, from the cache or measured
            once (profiling.py); proposer(): an AutoProposer (auto.py) planning from it and the acceptance so far
    learn   learn(): after a generation, its measured acceptance joins a running mean with what was known, so the
            next generation plans from it; the report names the strategy, split and placement chosen, and why

The Pipeline loads once, asks the planner, decodes, and hands the proposer back to learn; it holds no auto state.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from mirrorsd.errors import ProfileError
from mirrorsd.runtime.config import GenerationConfig
from mirrorsd.runtime.planner.ar_probe import ArProbe
from mirrorsd.runtime.planner.auto import AutoProposer, blend, running_weight
from mirrorsd.runtime.planner.latency import Strategy, split_name
from mirrorsd.runtime.planner.placement import PlacementChoice
from mirrorsd.runtime.planner.threads import ThreadChoice
from mirrorsd.runtime.planner.view import PipelineView


class Planner:
    def __init__(self, thread_choice: ThreadChoice, placement_choice: PlacementChoice | None = None) -> None:
        self.thread_choice = thread_choice  # the split the sessions opened with, and why
        self.placement_choice = placement_choice  # the (target, draft) devices, when chosen from profiles
        self.loaded = None  # this export's profile (profile.Profile), loaded or measured once
        self.acceptance = None  # the acceptance the last generations measured (else the profile's)
        self.measured_generations = 0  # generations whose acceptance went into ``acceptance``

    def profile(self, view: PipelineView, progress: bool = False, refresh: bool = False):
        """This export's profile on ``view``'s device set and thread split (profile.py): from the cache, else
        measured now (seconds to a minute) and cached."""
        from mirrorsd.runtime.planner.profiling import profile_for

        if self.loaded is None or refresh or self.loaded.split(*view.thread_key) is None:
            self.loaded = profile_for(view, progress, refresh)
        return self.loaded

    def use_profile(self, profile, thread_key: tuple[int, int, bool]) -> None:
        """Plan from ``profile`` (holding a split with ``thread_key``) instead of the measured one: a what-if, or a
        test that fixes the costs and keeps the measured acceptance."""
        if profile.split(*thread_key) is None:
            raise ProfileError("The profile has no split with this pipeline's threads",
                               f"the pipeline runs {split_name(*thread_key)} threads",
                               "add that split, or load the pipeline with matching threads")
        self.loaded = profile

    def costs(self, thread_key: tuple[int, int, bool]):
        """The loaded profile's costs of the split ``thread_key`` (profile() first)."""
        return self.loaded.split(*thread_key)

    def proposer(self, view: PipelineView, config: GenerationConfig, prompt_tokens: int,
                 fixed: Callable[[GenerationConfig], object]) -> AutoProposer:
        """The proposer of mode auto for a generation of ``config.max_new_tokens`` after ``prompt_tokens``: plans
        from the profile and the acceptance measured so far; ``fixed`` makes the proposer of a fixed-mode config."""
        profile = self.profile(view)
        prior = self.acceptance or profile.acceptance
        streaming = config.streaming and view.streaming_draft is not None
        probe = None if streaming else ArProbe(view.draft)  # (a streaming draft's acceptance is another one)
        return AutoProposer(lambda strategy: fixed(concrete(config, strategy)), self.costs(view.thread_key), prior,
                            streaming, context=prompt_tokens, new_tokens=config.max_new_tokens, probe=probe)

    def learn(self, proposer: AutoProposer) -> dict:
        """Fold a finished generation's measured acceptance into the running mean the next one plans from; the
        generation's auto report (strategy, switches, split, placement)."""
        online = proposer.measured_acceptance()
        if online.source == "online":
            self.measured_generations += 1
        weight = running_weight(self.measured_generations, self.loaded.calibration.get("prompts", 1))
        self.acceptance = blend(proposer.prior, online, weight)
        return {**proposer.report(), "threads": self.thread_choice.to_dict(),
                "placement": None if self.placement_choice is None else self.placement_choice.to_dict()}


def concrete(config: GenerationConfig, strategy: Strategy) -> GenerationConfig:
    """The fixed-mode config that runs ``strategy`` with ``config``'s other settings (auto's sd and mirror take the
    prompt-lookup lookahead unless ``config.ngram`` is False)."""
    return replace(config, mode=strategy.mode, gamma=max(strategy.gamma, 1), exit_head=strategy.exit_head,
                   streaming=strategy.streaming, ngram=config.ngram is not False,
                   draft_confidence=strategy.confidence)
