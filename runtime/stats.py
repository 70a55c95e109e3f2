"""Statistics of one generation, with the ecosystem's names (SpecBench's mean accepted tokens, AR = 1.00)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mirrorsd.runtime.sampling import SamplingParams


@dataclass
class StepCounters:
    """Per-generation counters; every decoding step adds to them."""

    steps: int = 0  # target verification passes after the prefill
    drafted: int = 0
    accepted: int = 0
    windows: int = 0  # steps that verified a draft window
    reused: int = 0  # windows taken from a pre-computed Mirror-SD branch
    fallbacks: int = 0  # windows drafted after the verdict (SD always; Mirror-SD on a branch miss)
    draft_forwards: int = 0
    branches_rolled_out: int = 0
    draft_failures: int = 0  # draft worker failures survived by falling back to target-only decoding

    def record(self, drafted: int, accepted: int, reused: bool | None, draft_forwards: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if reused is not None:
            self.windows += 1
            self.reused += int(reused)
            self.fallbacks += int(not reused)
        self.draft_forwards += draft_forwards


@dataclass(frozen=True)
class GenerationStats:
    mode: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    time_to_first_token_s: float
    tokens_per_second: float
    decode_tokens_per_second: float
    mean_accepted_tokens: float
    acceptance_rate: float
    reuse_rate: float
    fallback_rate: float
    steps: int
    drafted: int
    accepted: int
    windows: int
    reused: int
    fallbacks: int
    draft_forwards: int
    draft_forwards_per_window: float
    branches_rolled_out: int
    draft_failures: int
    target_busy_s: float
    draft_busy_s: float
    draft_hidden_s: float
    overlap_ratio: float
    finish_reason: str  # "eos" (an EOS token), "length" (max_new_tokens), "context" (the context limit)
    placement: dict[str, str] = field(default_factory=dict)
    auto: dict = field(default_factory=dict)  # mode auto: what it chose and why (the predicted table), switches

    def to_dict(self) -> dict:
        return asdict(self)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each list's intervals do not overlap each other)."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(mode: str, counters: StepCounters, prompt_tokens: int, new_tokens: int, seconds: float,
              ttft: float, target_busy: list, draft_busy: list, placement: dict[str, str],
              finish_reason: str, auto: dict | None = None) -> GenerationStats:
    decode_time = max(seconds - ttft, 1e-9)
    draft_time = sum(e - s for s, e in draft_busy)
    hidden = overlap_seconds(draft_busy, target_busy)
    return GenerationStats(
        mode=mode, prompt_tokens=prompt_tokens, new_tokens=new_tokens, seconds=seconds, time_to_first_token_s=ttft,
        tokens_per_second=new_tokens / max(seconds, 1e-9),
        decode_tokens_per_second=max(new_tokens - 1, 0) / decode_time,
        mean_accepted_tokens=(counters.accepted + counters.steps) / counters.steps if counters.steps else 1.0,
        acceptance_rate=counters.accepted / counters.drafted if counters.drafted else 0.0,
        reuse_rate=counters.reused / counters.windows if counters.windows else 0.0,
        fallback_rate=counters.fallbacks / counters.windows if counters.windows else 0.0,
        steps=counters.steps, drafted=counters.drafted, accepted=counters.accepted, windows=counters.windows,
        reused=counters.reused, fallbacks=counters.fallbacks, draft_forwards=counters.draft_forwards,
        draft_forwards_per_window=counters.draft_forwards / counters.windows if counters.windows else 0.0,
        branches_rolled_out=counters.branches_rolled_out, draft_failures=counters.draft_failures,
        target_busy_s=sum(e - s for s, e in target_busy), draft_busy_s=draft_time, draft_hidden_s=hidden,
        overlap_ratio=hidden / draft_time if draft_time > 0 else 0.0, finish_reason=finish_reason,
        placement=dict(placement), auto=dict(auto or {}))


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
