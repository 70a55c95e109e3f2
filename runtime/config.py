"""The settings of one generation, each defined once: here. The CLI and the bench take their flags' defaults and
choices from these classes.

    GenerationConfig   what ``Pipeline.generate`` reads: mode, budget, window, sampling, ... and the Mirror-SD
                       settings it inherits from MirrorSettings (the same names on the command line: --branches ->
                       branches)
    MirrorSettings     the part the Mirror-SD draft worker reads (``GenerationConfig.mirror``)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime.sampling import RULES

MODES = ("ar", "sd", "mirror", "ngram")  # target only; draft then verify; draft branches while the target verifies;
#                                         windows copied from earlier text (prompt lookup, runtime/ngram.py)
NGRAM_MAX = 16  # longest suffix n-gram a lookup may match
AUTO = "auto"  # the mode (and its settings) the latency model predicts fastest here (runtime/planner/auto.py)
MODE_CHOICES = (AUTO, *MODES)
CONCURRENT_MODES = ("mirror",)  # the draft runs beside the target: their sessions share the cores at the same time


def spins_in_run(mode: str) -> bool:
    """Whether a pipeline opened for ``mode`` lets ONNX Runtime's workers spin within a run (DeviceRequest.spin_in_run,
    devices/backends.py SPINNING_POOL): yes, unless the mode runs two sessions at once."""
    return mode not in CONCURRENT_MODES
BRANCH_BUDGETS = ("time", "cap")
DRAFT_FAILURE = ("raise", "fallback")
DRAFT_TIMEOUT_NEVER_S = 1e9  # a draft_timeout_s at or above this (about 31 years, or inf) waits without a limit
COUNTS = ("max_new_tokens", "gamma", "branches", "branch_batch", "runner_up_k")  # integers of at least COUNT_MIN
COUNT_MIN = 1
# These names, defaults and bounds are libmirrorsd's too: runtime/native/src/settings.hpp is generated from them
# (python -m mirrorsd.runtime.native.settings), and tests/test_native_settings.py fails when C differs.


@dataclass(frozen=True, kw_only=True)
class MirrorSettings:
    branches: int = 4  # branches rolled out per step at most (the cap beside the time budget)
    branch_batch: int = 2  # branches per batched draft rollout
    runner_up_k: int = 4  # the draft's own candidate tokens kept per window position
    branch_budget: str = "time"  # "time": stop at the verdict (the paper's overlap budget); "cap": always roll out
    #                              `branches` before reading the verdict (deterministic; tests and hit-rate studies)
    exit_head: bool = True  # hand the early exit's top-k to the worker (costs one LM-head pass per step)
    draft_timeout_s: float = 120.0  # the main thread gives up on a silent worker after this long

    @property
    def draft_wait_s(self) -> float | None:
        """draft_timeout_s as a wait's timeout: None (no limit) from DRAFT_TIMEOUT_NEVER_S up, which the threading
        module could not hold."""
        return None if self.draft_timeout_s >= DRAFT_TIMEOUT_NEVER_S else self.draft_timeout_s

    def check(self) -> None:
        for name in COUNTS[2:]:  # branches, branch_batch, runner_up_k
            _check_count(self, name)
        _check_choice(self, "branch_budget", BRANCH_BUDGETS)
        if isinstance(self.draft_timeout_s, bool) or not isinstance(self.draft_timeout_s, (int, float)) or \
                not self.draft_timeout_s > 0:  # NaN fails too
            raise GenerationInputError(f"draft_timeout_s must be a positive number of seconds, got "
                                       f"{self.draft_timeout_s!r}", "it bounds each wait for the draft worker",
                                       f"pass a value such as 120, or {DRAFT_TIMEOUT_NEVER_S:g} (or more) for no "
                                       "limit")


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(MirrorSettings):
    """Knobs of one generation. Defaults: auto (the fastest of ar, sd and mirror predicted from this machine's
    profile; it picks gamma and the exit head too), else gamma 4, up to 4 branches per step in batches of 2."""

    mode: str = AUTO
    max_new_tokens: int = 128
    gamma: int = 4  # draft window length (tokens proposed per step)
    chat: bool = True  # apply the chat template to a text prompt
    system: str | None = None
    record_margins: bool = False
    on_draft_failure: str = "raise"  # or "fallback": continue target-only, counted in statistics
    # Sampling, as in transformers' generation config. None = the export's generation defaults (its model's
    # generation_config.json), then transformers' own defaults. Greedy unless do_sample (temperature 0 = greedy).
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None  # 0 = off
    top_p: float | None = None  # 1 = off
    repetition_penalty: float | None = None  # 1 = off
    seed: int | None = None  # None: a fresh seed, reported in GenerationResult.sampling (the same seed = same tokens)
    verify: str = "exact"  # sd/mirror at T > 0: "exact" (target draws, draft must match) or "residual" (p/q rule)
    streaming: bool = True  # sd/mirror: draft with the export's streaming draft (draft_streaming) when it has one
    ngram: bool | None = None  # sd, mirror: fresh draft windows check a prompt-lookup guess as lookahead (same
    #                      windows, fewer forwards). None: the mode's default, off for sd and mirror, on for the sd and
    #                      mirror that auto runs (it measured 2-4 % faster in both benches of docs/bench)
    draft_confidence: float = 0.0  # sd: a draft window ends after its first token the draft gives a probability
    #                                below this (its top-1 softmax), at most gamma tokens; 0 = always gamma tokens.
    #                                Mode mirror ignores it (its windows are rolled out in the target's shadow)
    ngram_min: int = 2  # ngram, sd --ngram: the shortest earlier n-gram a lookup matches ...
    ngram_max: int = 4  # ... and the longest, tried first

    @property
    def mirror(self) -> MirrorSettings:
        """The Mirror-SD part, as the draft worker gets it."""
        return MirrorSettings(**{f.name: getattr(self, f.name) for f in fields(MirrorSettings)})

    def check(self) -> None:
        _check_choice(self, "mode", MODE_CHOICES)
        for name in COUNTS[:2]:  # max_new_tokens, gamma
            _check_count(self, name)
        super().check()
        _check_choice(self, "on_draft_failure", DRAFT_FAILURE)
        _check_choice(self, "verify", tuple(RULES))
        for name in ("ngram_min", "ngram_max"):
            _check_count(self, name)
        c = self.draft_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c < 1.0:  # NaN fails too
            raise GenerationInputError(f"draft_confidence must be a probability in [0, 1), got {c!r}",
                                       "a draft window ends after a token the draft gives less than it",
                                       "pass 0 (off, the default) or a value such as 0.4")
        if not self.ngram_min <= self.ngram_max <= NGRAM_MAX:
            raise GenerationInputError(f"ngram_min {self.ngram_min} and ngram_max {self.ngram_max} are out of order "
                                       f"or too long", "a lookup tries suffixes from ngram_max down to ngram_min",
                                       f"pass 1 <= ngram_min <= ngram_max <= {NGRAM_MAX} (defaults 2 and 4)")


def _check_count(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < COUNT_MIN:
        raise GenerationInputError(f"{name} must be a positive integer, got {value!r}",
                                   "it counts tokens or branches", f"pass {name} >= 1")


def _check_choice(config, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise GenerationInputError(f"{name} '{value}' is unknown", f"it is one of {', '.join(choices)}", "pick one")
