"""The rollout engine: every draft window, in sd and in mirror, comes from here.

It advances N rows of the draft together on one cache, g tokens each:

    fresh window   1 row on the draft's main cache, continuing the committed text    (sd; mirror after a miss)
    branches       N rows on a tiled copy of the main cache (which holds committed + the current window):
                   row r continues committed + window[:d_r - 1] + v_r; the window slots it does not take are
                   masked out (holes), so one batch serves every depth
    lookahead      (a streaming draft) each forward feeds a row's last pick plus the lookahead that its previous
                   forward's stream rows proposed; the row keeps the lookahead prefix that its own picks confirm
                   and drops the rest: truncated on the main cache, masked out (holes) in a branch batch. A forward
                   that may finish every row runs the plain graph (no stream rows needed)

    one forward    ids [N, width]: row r feeds its pending tokens (first forward: the uncached committed tokens,
                   or the branch token v) or its last pick, then its lookahead; shorter rows are padded with
                   masked slots. logits [N, width, vocab] -> each row's picks at its own columns
    cost           g forwards; with lookahead 1 + ceil((g - 1) / (n + 1)) when every lookahead holds, g at worst
    confidence     (fresh windows only) a window ends early, after its first pick whose softmax probability under
                   the draft is below a threshold: the draft stops where it is unsure, so a window on text it
                   cannot predict costs one forward and a short verification instead of g forwards. The rule reads
                   the draft's logits only, so the target still verifies every token and the output is unchanged

Every window token is its row's own pick at its position, drawn with the keyed draws of sampling.py (greedy:
the argmax): a branch's window is therefore exactly the one a fresh rollout after the verdict would draw (up to
float noise between batched and one-row forwards), and lookahead changes the number of forwards, never a token.
A hit branch is adopted by copying its row's KV slots (holes skipped) into the main cache: nothing is re-run.

The engine reaches the draft through ``forward`` / ``forward_streaming`` / ``sync_to`` / ``truncate`` / ``holds``
and its caches through ``length``, ``tiled``, ``truncate`` and ``adopt_slots`` only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from mirrorsd.runtime import models
from mirrorsd.runtime.kv_cache import KVCache
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import Branch, greedy_tokens, top1_probability, top_k_logprobs
from mirrorsd.runtime.view_cache import ViewCache

Between = Callable[[], bool]  # called after every forward; True abandons the rollout (the verdict wants another)


@dataclass(frozen=True)
class RowSlots:
    """Where a branch row's KV lies: the batch cache, the row, and the slots of the tokens it fed."""

    cache: KVCache | ViewCache
    row: int
    slots: np.ndarray  # [g] slots holding v, t_1 .. t_g-1 in order (a row with lookahead has holes between)


@dataclass(frozen=True)
class Window:
    """A rolled-out draft window: what the engine makes for each row, what Mirror-SD keeps for a branch, and what
    a proposer hands the decode loop."""

    tokens: np.ndarray  # [g] draft tokens following the row's text
    top_ids: np.ndarray  # [g, k] the draft's best tokens at each window position (k may be 0)
    top_logprobs: np.ndarray  # [g, k]
    probs: np.ndarray | None = None  # [g, vocab] float32 q each token was drawn from (residual rule), else None
    forwards: int = 0  # draft forwards it took; handed to the decode loop: forwards since the previous verdict
    reused: bool = False  # a branch rolled out before the verdict (Mirror-SD)
    kv: RowSlots | None = None  # branch rows: their KV, for adoption
    target_only: bool = False  # a step the strategy decodes without a draft (mode auto running ar): no window
    confidence: np.ndarray | None = None  # [g] the draft's top-1 probability at each pick (fresh windows that
    #                                       were asked for it), else None

    @classmethod
    def empty(cls, target_only: bool = False) -> "Window":
        """No window: target-only decoding, or a speculative step whose draft failed (counted as a fallback)."""
        return cls(np.zeros(0, np.int64), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32),
                   target_only=target_only)

    def cut(self, g: int) -> "Window":
        """The first ``g`` tokens (a shorter window near the token budget)."""
        kv = None if self.kv is None else replace(self.kv, slots=self.kv.slots[:g])
        return replace(self, tokens=self.tokens[:g], top_ids=self.top_ids[:g], top_logprobs=self.top_logprobs[:g],
                       probs=None if self.probs is None else self.probs[:g], kv=kv,
                       confidence=None if self.confidence is None else self.confidence[:g])


@dataclass
class _Row:
    """One row while it is rolled out."""

    feed: list[int]  # what it feeds before its lookahead: pending tokens, the branch token v, then its last pick
    position: int  # position of feed[0]
    context: list[int] | None  # its text through feed[-1] (read by the repetition penalty only)
    lookahead: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # its picks so far, and per pick:
    top: list[tuple] = field(default_factory=list)  # (top ids [k], top log-probs [k]) when top_k > 0
    probs: list[np.ndarray] = field(default_factory=list)  # q [vocab] when the sampler's drafts sample
    slots: list[int] = field(default_factory=list)  # the cache slot of the fed token before each pick
    confidence: list[float] = field(default_factory=list)  # the draft's top-1 probability at each pick (when read)
    stopped: bool = False  # its last pick fell below the confidence threshold: the window ends there


def fresh(draft: DraftModel, committed: list[int], gamma: int, sampler: Sampler = GREEDY, top_k: int = 0,
          lookahead: bool = False, guess: list[int] | None = None, confidence: float | None = None) -> Window:
    """Roll the draft's main cache back to ``committed``, then draft ``gamma`` tokens after it. The cache ends
    holding committed + window[:-1] (the last token is not fed). ``guess``: tokens expected to follow ``committed``
    (prompt lookup, ngram.py), fed as the first forward's lookahead: the window is the same, the forwards fewer
    where the draft's picks confirm the guess. ``confidence``: None = plain; else each pick's top-1 probability
    is recorded (Window.confidence), and a pick below ``confidence`` (> 0) ends the window after it."""
    pending = draft.sync_to(committed)
    if not pending:  # everything is cached: feed the last committed token again for its logits
        draft.truncate(len(committed) - 1)
        pending = committed[-1:]
    elif len(pending) > models.PREFILL_CHUNK:  # a prompt: read in chunks; its last token starts the window
        draft.prefill(pending[:-1])
        pending = pending[-1:]
    start = draft.cache.length
    row = _Row(list(pending), start, list(committed) if sampler.needs_context else None, list(guess or []))
    mask = np.ones((1, start), np.int64)  # [1, length]
    window, = _advance(draft, draft.cache, mask, [row], gamma, sampler, top_k, lookahead, True, None, confidence)
    draft.holds(start, [*pending, *window.tokens[:-1].tolist()])
    return window


def branches(draft: DraftModel, committed: list[int], window: np.ndarray, batch: list[Branch], sampler: Sampler,
             top_k: int, lookahead: bool, between: Between | None = None) -> list[Window] | None:
    """Roll out ``batch`` branches (d, v) of ``window`` together, one row each, on a tiled copy of the main cache
    (which holds committed + the whole window); each Window records its row's KV. None when ``between`` abandoned
    the batch."""
    g = len(window)
    base = draft.cache
    cache = base.tiled(len(batch), g * (draft.streams + 1) if lookahead else g)
    mask = np.ones((len(batch), base.length), np.int64)  # [rows, length]
    rows = []
    for r, branch in enumerate(batch):
        keep = len(committed) + branch.depth - 1  # the branch point: later window slots are holes in this row
        mask[r, keep:] = 0
        context = committed + window[:branch.depth - 1].tolist() + [branch.token] if sampler.needs_context else None
        rows.append(_Row([int(branch.token)], keep, context))
    return _advance(draft, cache, mask, rows, g, sampler, top_k, lookahead, False, between)


def adopt(draft: DraftModel, window: Window, committed: list[int]) -> None:
    """Make a hit branch the draft's state: its row's KV (v = the correction, t_1 .. t_g-1) goes into the main
    cache after committed[:-1], which then holds committed + window[:-1], exactly as after a fresh rollout."""
    g = len(window.tokens)
    keep = len(committed) - 1
    draft.cache.adopt_slots(window.kv.cache, window.kv.row, window.kv.slots[:g], keep)
    draft.holds(keep, [committed[-1], *window.tokens[:g - 1].tolist()])


def _advance(draft: DraftModel, cache: KVCache | ViewCache, mask: np.ndarray, rows: list[_Row], gamma: int,
             sampler: Sampler, top_k: int, lookahead: bool, compact: bool, between: Between | None,
             confidence: float | None = None) -> list[Window] | None:
    """Advance ``rows`` on ``cache`` (``mask`` [rows, cache.length]) until each has ``gamma`` picks (or stopped
    below ``confidence``, see fresh). ``compact``: one row on the main cache, whose rejected lookahead slots are
    truncated instead of masked."""
    forwards = 0
    while True:
        fed = [_fed(row, gamma) for row in rows]
        width = max(len(f) for f in fed)
        if width == 0:
            break
        if all(len(f) == width for f in fed):
            ids, new_mask = np.array(fed, np.int64), np.ones((len(rows), width), np.int64)  # [rows, width]
        else:  # padding slots are masked out
            ids, new_mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
            for r, f in enumerate(fed):
                ids[r, :len(f)], new_mask[r, :len(f)] = f, 1
        positions = np.array([row.position for row in rows], np.int64)[:, None] + np.arange(width)  # [rows, width]
        first_slot = cache.length
        mask = np.concatenate([mask, new_mask], axis=1)
        # a forward that may finish every row needs no next lookahead: the plain graph is cheaper
        plain = not lookahead or all(len(f) - len(row.feed) + 1 >= gamma - len(row.tokens)
                                     for row, f in zip(rows, fed) if f)
        if plain:  # picks read each row's columns from its last fed token on: a graph that can skips the others
            first = min(len(row.feed) - 1 for row, f in zip(rows, fed) if f)
            logits, streams = draft.forward(cache, ids, mask, positions, first), None
        else:
            logits, streams = draft.forward_streaming(cache, ids, mask, positions)
        forwards += 1
        ends = _pick(rows, fed, logits, positions, sampler, top_k, confidence)
        for r, (row, f) in enumerate(zip(rows, fed)):
            if not f:
                continue
            end = ends[r]  # columns [end, width) of this row are rejected lookahead or padding
            if not compact:
                row.slots.extend(range(first_slot + len(row.feed) - 1, first_slot + end))
                mask[r, first_slot + end:] = 0  # holes in this row
            elif end < width:
                cache.truncate(first_slot + end)
                mask = mask[:, :first_slot + end]
            row.position += end
            full = streams is not None and end == len(f) == width  # streams hang on the last column
            row.lookahead = greedy_tokens(streams[r]).tolist() if full else []
            row.feed = row.tokens[-1:]
        if between is not None and between():
            return None
    return [_window(row, forwards, None if compact else RowSlots(cache, r, np.asarray(row.slots, np.int64)))
            for r, row in enumerate(rows)]


def _fed(row: _Row, gamma: int) -> list[int]:
    """What ``row`` feeds next: its feed, then as much lookahead as may still be needed (nothing once done)."""
    need = 0 if row.stopped else gamma - len(row.tokens)
    return [*row.feed, *row.lookahead[:need - 1]] if need > 0 else []


def _pick(rows: list[_Row], fed: list[list[int]], logits: np.ndarray, positions: np.ndarray, sampler: Sampler,
          top_k: int, confidence: float | None = None) -> list[int]:
    """Each row's picks after its feed (logits [rows, width - skipped, vocab]: the graph may leave out the first
    columns, which no pick reads); a row keeps the lookahead prefix its picks confirm, plus the pick after it, and
    with a ``confidence`` threshold nothing after its first pick below it. Returns per row the first column it does
    not keep."""
    width = positions.shape[1]
    skipped = width - logits.shape[1]  # columns before the first that any row picks from
    if all(len(f) == len(row.feed) == width for row, f in zip(rows, fed)):  # no lookahead, no padding
        rr, cc = range(len(rows)), [width - 1] * len(rows)
        chosen, after = logits[:, -1], positions[:, -1] + 1  # [rows, vocab], [rows]
    else:
        rr, cc = [], []  # the columns to pick from: each row's from its last fed token on
        for r, (row, f) in enumerate(zip(rows, fed)):
            columns = range(len(row.feed) - 1, len(f))
            rr += [r] * len(columns)
            cc += columns
        chosen, after = logits[rr, [c - skipped for c in cc]], positions[rr, cc] + 1  # [columns, vocab], [columns]
    contexts = [rows[r].context + fed[r][len(rows[r].feed):c + 1] for r, c in zip(rr, cc)] \
        if rows[0].context is not None else None
    picks, q = sampler.draft(chosen, after, contexts)  # drawn at the positions where a fresh rollout would draw
    picks = picks.tolist()
    top = top_k_logprobs(chosen, top_k) if top_k else None
    ends, i = [0] * len(rows), 0
    for r, (row, f) in enumerate(zip(rows, fed)):
        if not f:
            continue
        base, kept = len(row.feed) - 1, 0
        while base + kept + 1 < len(f) and f[base + kept + 1] == picks[i + kept]:
            kept += 1
        if confidence is not None:
            sure = top1_probability(chosen[i:i + kept + 1]).tolist()  # [kept + 1]
            unsure = [j for j, p in enumerate(sure) if p < confidence]
            if unsure:  # the window ends at its first unsure pick (confidence 0 never stops: p > 0)
                kept, row.stopped = unsure[0], True
            row.confidence += sure[:kept + 1]
        new = picks[i:i + kept + 1]
        row.tokens += new
        if top is not None:
            row.top += [(top[0][c], top[1][c]) for c in range(i, i + kept + 1)]
        if q is not None:
            row.probs += [q[c] for c in range(i, i + kept + 1)]
        if row.context is not None:
            row.context = row.context + new
        ends[r] = base + kept + 1
        i += len(f) - base
    return ends


def _window(row: _Row, forwards: int, kv: RowSlots | None) -> Window:
    g = len(row.tokens)
    top_ids, top_lps = (np.stack(t) for t in zip(*row.top)) if row.top else \
        (np.zeros((g, 0), np.int64), np.zeros((g, 0), np.float32))
    return Window(np.asarray(row.tokens, np.int64), top_ids, top_lps, np.stack(row.probs) if row.probs else None,
                  forwards, kv=kv, confidence=np.asarray(row.confidence) if row.confidence else None)
