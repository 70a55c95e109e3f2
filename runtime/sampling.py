"""Sampling (T > 0): transformers' logits processors in NumPy, keyed draws, and the Sampler that the decode loop
and every draft share. Greedy decoding is the Sampler's plain path: argmax of the raw logits, as before.

    logits -> repetition penalty -> [do_sample: temperature -> top-k -> top-p] -> softmax = p
              (the order of transformers' _get_logits_processor; as there, the penalty applies to greedy too)

Keyed draws. Every random decision reads one uniform u(seed, draw, n): n is the absolute position (prompt
included) of the token being decided, the draw kind says what it decides. Nothing is advanced, so no draw depends on
how many draws happened before it.
    TARGET  the target's draw at n (exact rule, ar, the bonus) or the residual resample at n (residual rule)
    ACCEPT  the accept/reject coin for the draft token at n (residual rule)
    DRAFT   the draft's draw at n (residual rule; under the exact rule the draft proposes the mode of q, which
            maximises the chance p(y^) of matching the target's draw when the two models agree on the mode)

Why both rules stay lossless in sd and mirror, and why mirror's thread timing never changes a token:
 1. The committed tokens before n, and where the current window starts, are functions of the uniforms at
    positions < n only: a verdict at m reads the window up to m, whose tokens were drawn at positions <= m. So the
    uniforms at n are fresh when n is decided. A draft token drawn at n by an earlier window that was rejected
    before n was never read by any verdict; drawing at n again with the same uniform in the new context is, as far
    as the committed text can tell, a fresh draw.
 2. Given the committed prefix, the token at n is distributed as p(. | prefix):
    exact     it is inverse_cdf(p, u_TARGET(n)) whatever the draft proposed; that is ar's token for this seed too,
              so sd and mirror reproduce ar token for token (up to float rounding at a CDF boundary).
    residual  the draft token x ~ q(. | prefix) (drawn with u_DRAFT(n)) is kept with probability min(1, p(x)/q(x))
              (u_ACCEPT(n)), else c ~ norm(max(0, p - q)) (u_TARGET(n)): P(c = y) = min(q, p)(y) + max(0, p - q)(y)
              = p(y). The bonus is drawn from p with u_TARGET(n).
 3. Mirror's branches. A draft token at n is a function of (its context, seed, n) only. A branch (d, v) rolled out
    before the verdict continues committed + window[:d-1] + v, which is exactly the committed text after a verdict
    (A, c) = (d - 1, v), and it draws its tokens at the positions a fresh rollout would, from the same q (the same
    processors on the same context). So an adopted branch IS the window that drafting after the verdict would
    give: reuse changes latency, never tokens, and which branches happened to finish (budget "time" or "cap",
    thread timing) changes nothing. The verdict (A, c) reads only the current window and its q; the branch's own
    q travels with it and is read at the next verdict, as a window drafted after the verdict would be.
    (Float caveat: a batched branch rollout may round logits differently from a single-row one. A token then
    differs only if a uniform falls within that rounding of a CDF boundary, and the distribution is unaffected:
    the q read at the verdict is always the q the token was drawn from.)
"""
from __future__ import annotations

import functools
import operator
import secrets
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime.verify import (Verdict, greedy_tokens, inverse_cdf, verify_exact_sampled, verify_greedy,
                                     verify_residual)

TARGET, ACCEPT, DRAFT = 0, 1, 2  # the kinds of keyed draw (see the module docstring)
MIN_TEMPERATURE = 1e-6  # logits / T stays finite in float32 for any logit below 3e32 (colder: use 0, greedy)
UNIFORM_BLOCK = 256  # uniforms are made 256 positions at a time: one generator per block, not per draw
# What a key missing from an export's generation defaults means: transformers' GenerationConfig defaults.
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingParams:
    """The four processors of transformers' generation config, a seed, and the speculative verification rule."""

    do_sample: bool = False
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages every token already in prompt + output
    seed: int = 0
    verify: str = "exact"  # "exact" or "residual" (see RULES)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def resolve(cls, defaults: Mapping, seed: int | None = None, verify: str = "exact",
                **overrides) -> "SamplingParams":
        """Transformers' defaults <- an export's ``generation_defaults`` <- the non-None ``overrides``.

        A missing seed becomes a fresh random one (kept in the result, so the run can be repeated).
        """
        values = dict(TRANSFORMERS_DEFAULTS)
        values.update({k: defaults[k] for k in TRANSFORMERS_DEFAULTS if defaults.get(k) is not None})
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(TRANSFORMERS_DEFAULTS)
        if unknown:
            raise GenerationInputError(f"Unknown sampling setting(s) {sorted(unknown)}",
                                       f"the settings are {', '.join(TRANSFORMERS_DEFAULTS)}", "check the spelling")
        try:
            params = cls(bool(values["do_sample"]), float(values["temperature"]), operator.index(values["top_k"]),
                         float(values["top_p"]), float(values["repetition_penalty"]),
                         secrets.randbits(63) if seed is None else operator.index(seed), verify)
        except (TypeError, ValueError) as exc:
            raise GenerationInputError("A sampling setting has the wrong type", str(exc),
                                       "pass numbers (top_k and seed: integers)") from None
        params.check()
        return params

    def check(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature {self.temperature} (use >= 0; 0 = greedy)")
        elif 0 < self.temperature < MIN_TEMPERATURE and self.do_sample:
            problems.append(f"temperature {self.temperature} (float32 logits divided by it overflow to inf; use "
                            f">= {MIN_TEMPERATURE:g}, or 0 for greedy)")
        if self.top_k < 0:
            problems.append(f"top_k {self.top_k} (use >= 0; 0 = off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p {self.top_p} (use 0 < top_p <= 1; 1 = off)")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty {self.repetition_penalty} (use > 0; 1 = off)")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            problems.append(f"seed {self.seed!r} (use an integer in 0..2**63-1)")
        if self.verify not in RULES:
            problems.append(f"verify '{self.verify}' (use {' or '.join(RULES)})")
        if problems:
            raise GenerationInputError(f"Invalid sampling settings: {'; '.join(problems)}",
                                       "they follow transformers' generation config", "fix the values listed")


def process_logits(logits: np.ndarray, params: SamplingParams, contexts: Sequence[Sequence[int]] | None = None,
                   warp: bool = True) -> np.ndarray:
    """logits [S, V] -> processed logits [S, V] float32, removed tokens at -inf (a new array).

    contexts[s]: the token ids before row s (prompt + output so far), read by the repetition penalty only.
    warp=False stops after the penalty (enough for an argmax: the warpers never move it).
    """
    x = np.array(logits, np.float32)  # copy: the caller's logits stay as they are
    if params.repetition_penalty != 1.0:
        if contexts is None or len(contexts) != len(x):
            raise ValueError("the repetition penalty needs one context per row")
        for row, context in zip(x, contexts):
            ids = np.asarray(context, np.int64)
            seen = row[ids]  # gathered before the write: a repeated id is penalised once, as in transformers
            row[ids] = np.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
    if params.greedy or not warp:
        return x
    if params.temperature != 1.0:
        x /= params.temperature
    vocab = x.shape[-1]
    if params.top_k > 0:
        k = min(params.top_k, vocab)
        kth = np.partition(x, vocab - k, axis=-1)[:, vocab - k: vocab - k + 1]  # [S, 1] the k-th largest
        x[x < kth] = -np.inf  # ties with the k-th all stay, as in transformers
    if params.top_p < 1.0:
        for row in x:
            _nucleus(row, params.top_p)
    return x


def _nucleus(row: np.ndarray, top_p: float) -> None:
    """Top-p in place. transformers drops a token when the ascending cumulative mass up to it is <= 1 - top_p, i.e.
    when the mass of the tokens above it is >= top_p; those tokens all lie outside any top-m set holding top_p."""
    probs = softmax(row)
    vocab, m = len(row), min(len(row), 64)
    while True:
        top = np.argpartition(-probs, m - 1)[:m] if m < vocab else np.arange(vocab)
        if m == vocab or probs[top].sum() >= top_p:
            break
        m = min(vocab, m * 8)
    order = top[np.argsort(-probs[top], kind="stable")]
    above = np.cumsum(probs[order]) - probs[order]
    drop = np.ones(vocab, bool)
    drop[order[above < top_p]] = False
    row[drop] = -np.inf


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float64 (-inf -> probability 0)."""
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@functools.lru_cache(maxsize=4096)
def _uniform_block(seed: int, draw: int, block: int) -> np.ndarray:
    out = np.random.default_rng([seed, draw, block]).random(UNIFORM_BLOCK)
    out.flags.writeable = False
    return out


def uniforms(seed: int, draw: int, positions) -> np.ndarray:
    """u(seed, draw, n) in [0, 1) for each position n: independent across (seed, draw kind, n), never advanced."""
    return np.array([_uniform_block(seed, draw, int(n) // UNIFORM_BLOCK)[int(n) % UNIFORM_BLOCK]
                     for n in positions], np.float64)


class _TargetRows:
    """p_i of a verification window, computed when a rule first reads row i (rules stop at the verdict)."""

    def __init__(self, logits: np.ndarray, committed: list[int], window: np.ndarray, params: SamplingParams) -> None:
        self.logits, self.committed, self.window, self.params = logits, committed, window, params
        self._rows: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._rows:
            context = [self.committed + self.window[:i].tolist()] if self.params.repetition_penalty != 1.0 else None
            self._rows[i] = softmax(process_logits(self.logits[i:i + 1], self.params, context))[0]
        return self._rows[i]


def _exact(window, draft_probs, target_probs, accept_uniforms, sample_uniforms) -> Verdict:
    return verify_exact_sampled(window, target_probs, sample_uniforms)


def _residual(window, draft_probs, target_probs, accept_uniforms, sample_uniforms) -> Verdict:
    if len(window) and draft_probs is None:
        raise ValueError("the residual rule needs the draft's distributions q with the window")
    return verify_residual(window, draft_probs, target_probs, accept_uniforms, sample_uniforms)


RULES = {"exact": _exact, "residual": _residual}  # verification rules at T > 0, by name


@dataclass(frozen=True)
class Sampler:
    """Picks tokens for the target (first token, verification) and for the drafts; stateless, so threads share it."""

    params: SamplingParams = SamplingParams()

    @property
    def plain(self) -> bool:
        """The original greedy path: argmax of the raw logits, no processing at all."""
        return self.params.greedy and self.params.repetition_penalty == 1.0

    @property
    def needs_context(self) -> bool:
        """Whether ``draft`` must be given each row's context (the repetition penalty reads it)."""
        return self.params.repetition_penalty != 1.0

    @property
    def drafts_sample(self) -> bool:
        """Whether drafts draw from q and hand q over (the residual rule at T > 0)."""
        return not self.params.greedy and self.params.verify == "residual"

    def first_token(self, logits: np.ndarray, committed: list[int]) -> int:
        """logits [1, V] after ``committed`` (the prompt) -> the first new token."""
        if self.plain:
            return int(greedy_tokens(logits)[0])
        return self.verify(np.zeros(0, np.int64), None, logits, committed).correction

    def verify(self, window: np.ndarray, draft_probs: np.ndarray | None, logits: np.ndarray,
               committed: list[int]) -> Verdict:
        """window [g] after ``committed``, its q [g, V] (residual rule), target logits [g + 1, V] -> Verdict."""
        if self.plain:
            return verify_greedy(window, greedy_tokens(logits))
        if self.params.greedy:  # greedy with a repetition penalty: argmax of the penalised logits
            contexts = [committed + window[:i].tolist() for i in range(len(logits))]
            return verify_greedy(window, greedy_tokens(process_logits(logits, self.params, contexts, warp=False)))
        g, seed = len(window), self.params.seed
        positions = len(committed) + np.arange(g + 1)
        return RULES[self.params.verify](window, draft_probs, _TargetRows(logits, committed, window, self.params),
                                         uniforms(seed, ACCEPT, positions[:g]), uniforms(seed, TARGET, positions))

    def draft(self, logits: np.ndarray, positions, contexts: Sequence[Sequence[int]] | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Draft logits [R, V] for tokens at absolute ``positions`` [R] -> (tokens [R], q [R, V] float32 or None).

        q (only when ``drafts_sample``) is the distribution each token was drawn from, as the residual rule reads it.
        """
        if self.plain:
            return greedy_tokens(logits), None
        if not self.drafts_sample:  # greedy, or the exact rule: the mode of q
            return greedy_tokens(process_logits(logits, self.params, contexts, warp=False)), None
        q = softmax(process_logits(logits, self.params, contexts)).astype(np.float32)
        u = uniforms(self.params.seed, DRAFT, positions)
        return np.array([inverse_cdf(row, ui) for row, ui in zip(q, u)], np.int64), q


GREEDY = Sampler()
