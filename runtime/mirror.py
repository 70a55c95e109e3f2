"""Mirror-SD: the draft rolls out branches on its own thread while the target verifies the current window.

    main thread (target device)                     draft worker (draft device)
    ---------------------------                     ---------------------------
    propose(): wait for a window        <-- Window --  fresh rollout, or a ready branch
    prefix([last] + window)                          extend: one forward on the window's last token
    exit head -> top-k per position     -- Exit ---> re-rank candidate branches (draft runner-ups first)
    suffix -> target tokens -> verdict               roll out branches (d, v) in batches, best first,
    observe(verdict)                    -- Verdict->   until the verdict arrives or the cap is reached
                                                     branch (A+1, c) ready? adopt its KV + tokens (reuse)
                                                     else roll out afresh (fallback)
Only token ids and log-probs cross between the threads (and, for the residual sampling rule, each window's q).
At T > 0 every draft token is drawn with keyed randomness (sampling.py): a branch's window is the one a fresh
rollout after the verdict would draw, so reuse never changes the tokens, whatever the timing.
The worker owns the draft model and its caches; the main thread never touches them. A worker failure reaches the
caller as DraftWorkerError; nothing busy-waits (the worker polls its inbox only between draft forwards, and blocks
when it has nothing to do).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime.kv_cache import KVCache
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.proposers import Proposal, draft_rollout
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.streaming import StreamingDraftModel
from mirrorsd.runtime.verify import Verdict, greedy_tokens, rank_branches, top_k_logprobs


@dataclass(frozen=True)
class MirrorSettings:
    max_branches: int = 4  # branches rolled out per step at most (the cap beside the time budget)
    branch_batch: int = 2  # branches per batched rollout
    runner_up_k: int = 4  # the draft's own candidate tokens kept per window position
    timeout_s: float = 120.0  # the main thread gives up on a silent worker after this long
    budget: str = "time"  # "time": stop at the verdict (the paper's overlap budget); "cap": always roll out
    #                       max_branches before reading the verdict (deterministic; for tests and hit-rate studies)
    use_exit_head: bool = True  # hand the early exit's top-k to the worker (costs one LM-head pass per step)


# Messages (main -> worker)
@dataclass(frozen=True)
class _Prefill:
    tokens: list[int]


@dataclass(frozen=True)
class _Propose:
    committed: list[int]
    gamma: int


@dataclass(frozen=True)
class _Exit:
    ids: np.ndarray  # [g + 1, k] early-exit top-k per window position
    logprobs: np.ndarray


@dataclass(frozen=True)
class _Verdict:
    verdict: Verdict
    new_tokens: list[int]
    gamma: int


class _Stop:
    """Generation over (or failed): the worker drops what it was doing and exits."""


# Messages (worker -> main)
@dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclass
class _Window:
    """A window and what the worker knows about it (the draft's top-k at each position)."""

    tokens: np.ndarray  # [g]
    top_ids: np.ndarray  # [g + 1, k] (row g filled by the extend forward)
    top_logprobs: np.ndarray
    base_length: int  # committed tokens when the window was drafted (C)
    probs: np.ndarray | None = None  # [g, vocab] q per token (residual rule)


@dataclass
class _Ready:
    cache: KVCache  # the batch cache holding this branch as one row
    row: int
    tokens: np.ndarray  # [g] the branch's rollout: the next window if the verdict hits it
    top_ids: np.ndarray  # [g, k]
    top_logprobs: np.ndarray
    slots: np.ndarray  # [g] cache slots holding the row's fed tokens v, t_1 .. t_g-1 (a streamed row has holes)
    probs: np.ndarray | None = None  # [g, vocab] q per token (residual rule)


@dataclass
class AcceptanceEstimate:
    """Running per-token acceptance probability: accepted / (accepted + rejections), exponentially decayed."""

    accepted: float = 7.0  # prior: 0.7 with the weight of a few steps
    rejected: float = 3.0
    decay: float = 0.95

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, verdict: Verdict) -> None:
        self.accepted = self.decay * self.accepted + verdict.accepted
        self.rejected = self.decay * self.rejected + (0 if verdict.bonus else 1)


@dataclass
class WorkerCounters:
    branches: int = 0
    forwards_since_verdict: int = 0
    busy: list[tuple[float, float]] = field(default_factory=list)


class DraftWorker(threading.Thread):
    """Owns the draft model; answers each verdict with the next window."""

    def __init__(self, draft: DraftModel, settings: MirrorSettings, sampler: Sampler = GREEDY,
                 rollout=draft_rollout) -> None:
        super().__init__(name="mirrorsd-draft", daemon=True)
        self.draft, self.settings, self.sampler = draft, settings, sampler
        self.rollout = rollout  # fresh windows: draft_rollout, or streaming_rollout for a streaming draft
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.committed: list[int] = []
        self.counters = WorkerCounters()
        self._ready: dict[tuple[int, int], _Ready] = {}
        self.acceptance = AcceptanceEstimate()

    # ---- thread body -------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            message = self.inbox.get()
            while not isinstance(message, _Stop):
                message = self._serve(message)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            self.outbox.put(_Failed(exc))

    def _serve(self, message):
        """Handle one request; return the next message to handle (speculation consumes messages itself)."""
        if isinstance(message, _Prefill):
            self.committed = list(message.tokens)
            self.draft.reset(capacity=len(message.tokens) + 64)
            pending = self.draft.sync_to(self.committed)
            if pending:
                self.draft.extend(pending)
            return self.inbox.get()
        if isinstance(message, _Propose):
            self.committed = list(message.committed)
            window, reused = self._fresh(message.gamma), False
            while True:
                self._deliver(window, reused)
                message = self._speculate(window)
                if not isinstance(message, _Verdict):
                    break
                window, reused = self._next_window(window, message)
            return message
        return self.inbox.get()  # a stale exit message

    # ---- windows -----------------------------------------------------------------------------------------
    def _fresh(self, gamma: int) -> _Window:
        k = self.settings.runner_up_k
        start = time.perf_counter()
        rollout = self.rollout(self.draft, self.committed, gamma, k, self.sampler)
        self.counters.busy.append((start, time.perf_counter()))
        self.counters.forwards_since_verdict += rollout.forwards
        pad = np.zeros((1, k), np.int64), np.full((1, k), -np.inf, np.float32)
        return _Window(rollout.tokens, np.concatenate([rollout.top_ids, pad[0]]),
                       np.concatenate([rollout.top_logprobs, pad[1]]), len(self.committed), rollout.probs)

    def _deliver(self, window: _Window, reused: bool) -> None:
        self.outbox.put(self._proposal(window, reused))

    def _proposal(self, window: _Window, reused: bool) -> Proposal:
        proposal = Proposal(window.tokens.copy(), reused, self.counters.forwards_since_verdict, window.probs)
        self.counters.forwards_since_verdict = 0
        return proposal

    def _next_window(self, window: _Window, message: _Verdict) -> tuple[_Window, bool]:
        """Apply a verdict: adopt the branch it hits if that one is ready, else draft afresh."""
        verdict = message.verdict
        self.acceptance.update(verdict)
        self.committed.extend(message.new_tokens)
        ready = self._ready.get(verdict.branch)
        self._ready = {}
        if ready is not None and len(ready.tokens) >= message.gamma:
            g = message.gamma
            keep = window.base_length + verdict.accepted  # committed + accepted window tokens
            self.draft.cache.adopt_slots(ready.cache, ready.row, ready.slots[:g], keep)
            self.draft.cache_tokens[keep:] = [verdict.correction, *ready.tokens[: g - 1].tolist()]
            k = self.settings.runner_up_k
            pad = np.zeros((1, k), np.int64), np.full((1, k), -np.inf, np.float32)
            return _Window(ready.tokens[:g].copy(), np.concatenate([ready.top_ids[:g], pad[0]]),
                           np.concatenate([ready.top_logprobs[:g], pad[1]]), len(self.committed),
                           None if ready.probs is None else ready.probs[:g]), True
        return self._fresh(message.gamma), False

    # ---- speculation -------------------------------------------------------------------------------------
    def _speculate(self, window: _Window):
        """Roll out branches of ``window`` until a verdict (or End/Stop) must be answered; return that message."""
        self._ready = {}
        cap_mode = self.settings.budget == "cap"
        exit_msg, held, extended = None, None, False
        spent: set[tuple[int, int]] = set()
        message = self._poll()
        while True:
            if isinstance(message, _Exit):
                exit_msg = message
            elif isinstance(message, _Verdict) and cap_mode:
                held = message
            elif message is not None:
                return message
            if not extended:
                self._extend_last(window)
                extended = True
                message = self._poll()
                continue
            batch = []
            if len(spent) < self.settings.max_branches:
                room = min(self.settings.branch_batch, self.settings.max_branches - len(spent))
                batch = rank_branches(window.tokens, window.top_ids, window.top_logprobs,
                                      exit_msg.ids if exit_msg else None, exit_msg.logprobs if exit_msg else None,
                                      self.acceptance.rate, frozenset(spent), room)
            if batch:
                spent.update((b.depth, b.token) for b in batch)
                message = self._roll_out(window, batch, abandon=not cap_mode)
            elif held is not None:
                return held
            else:
                message = self.inbox.get()  # nothing left worth doing: block until told

    def _extend_last(self, window: _Window) -> None:
        """One forward on the window's last token: the draft's own candidates after a fully accepted window."""
        # The main cache holds exactly committed + window[:-1] here (fresh rollout or adopted branch).
        start = time.perf_counter()
        logits = self.draft.extend([int(window.tokens[-1])])
        self.counters.busy.append((start, time.perf_counter()))
        self.counters.forwards_since_verdict += 1
        ids, lps = top_k_logprobs(logits[-1:], self.settings.runner_up_k)
        window.top_ids[-1], window.top_logprobs[-1] = ids[0], lps[0]

    def _branch_rows(self, window: _Window, batch, extra: int):
        """A tiled cache, mask, next positions [rows] and contexts for ``batch``: row r continues
        committed + window[:d_r - 1] + v_r. The rows share the main cache's slots; slots beyond each row's branch
        point are masked out (holes), so one tiled cache serves every depth."""
        base = self.draft.cache  # committed + the whole window
        cache = base.tiled(len(batch), extra)
        mask = np.ones((len(batch), base.length), np.int64)
        positions = np.empty(len(batch), np.int64)
        for r, branch in enumerate(batch):
            keep = window.base_length + branch.depth - 1
            mask[r, keep:] = 0
            positions[r] = keep
        contexts = [self.committed + window.tokens[:b.depth - 1].tolist() + [b.token] for b in batch] \
            if self.sampler.needs_context else None  # each row's text so far (repetition penalty)
        return cache, mask, positions, contexts

    def _after_forward(self, batch, message, abandon: bool):
        """Poll between forwards; (message, stop): stop when the verdict wants a branch outside ``batch``."""
        if message is not None:
            return message, False
        message = self._poll()
        if isinstance(message, _Verdict) and abandon:
            if not any((b.depth, b.token) == message.verdict.branch for b in batch):
                return message, True  # abandon: the verdict wants another branch
        elif message is not None and not isinstance(message, (_Exit, _Verdict)):
            return message, True
        return message, False

    def _roll_out(self, window: _Window, batch, abandon: bool) -> object | None:
        """Roll out ``batch`` branches together, one row each. Returns a message that arrived meanwhile."""
        if isinstance(self.draft, StreamingDraftModel):
            return self._roll_out_streamed(window, batch, abandon)
        g, rows = len(window.tokens), len(batch)
        cache, mask, next_positions, contexts = self._branch_rows(window, batch, g)
        positions = next_positions[:, None]  # [rows, 1]
        ids = np.array([[b.token] for b in batch], np.int64)
        tokens, top_ids, top_lps, probs = [], [], [], []
        message = None
        for step in range(g):
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
            start = time.perf_counter()
            logits = self.draft.forward(cache, ids, mask, positions)[:, -1]  # [rows, vocab]
            self.counters.busy.append((start, time.perf_counter()))
            self.counters.forwards_since_verdict += 1
            tids, tlps = top_k_logprobs(logits, self.settings.runner_up_k)
            picked, q = self.sampler.draft(logits, positions[:, 0] + 1, contexts)  # drawn where a fresh rollout would
            tokens.append(picked)
            top_ids.append(tids)
            top_lps.append(tlps)
            probs.append(q)
            if contexts is not None:
                contexts = [c + [int(t)] for c, t in zip(contexts, picked)]
            ids, positions = picked[:, None].astype(np.int64), positions + 1
            message, stop = self._after_forward(batch, message, abandon)
            if stop:
                return message
        self.counters.branches += rows
        stacked = np.stack(tokens, axis=1), np.stack(top_ids, axis=1), np.stack(top_lps, axis=1)  # [rows, g, ...]
        q = np.stack(probs, axis=1) if probs[0] is not None else None  # [rows, g, vocab]
        slots = np.arange(cache.length - g, cache.length)  # one new slot per forward, the same for every row
        for r, branch in enumerate(batch):
            self._ready[(branch.depth, branch.token)] = _Ready(cache, r, stacked[0][r], stacked[1][r], stacked[2][r],
                                                               slots, None if q is None else q[r])
        return message

    def _roll_out_streamed(self, window: _Window, batch, abandon: bool) -> object | None:
        """``_roll_out`` with a streaming draft: each row feeds its last pick plus its lookahead (the streams of
        its previous forward), keeps the lookahead prefix its own main-stream picks confirm, and masks the rest
        out (holes in that row). Rows have lookaheads of different lengths: shorter rows are padded with masked
        slots, and only rows that fill the width get valid streams (the streams hang on the last column).
        Every window token is still the row's main-stream pick at its position: the same window as ``_roll_out``
        (up to float noise between the two graphs), in fewer forwards."""
        g, rows, k = len(window.tokens), len(batch), self.settings.runner_up_k
        cache, mask, positions, contexts = self._branch_rows(window, batch, g * (self.draft.streams + 1))
        last = [int(b.token) for b in batch]  # the token each row feeds next
        lookahead: list[list[int]] = [[] for _ in batch]
        made: list[list[tuple]] = [[] for _ in batch]  # per row: (token, top ids, top log-probs, q)
        slots: list[list[int]] = [[] for _ in batch]  # per row: the cache slots of its fed tokens, in order
        message = None
        while any(len(m) < g for m in made):
            need = [g - len(m) for m in made]
            fed = [[last[r], *lookahead[r][: max(need[r] - 1, 0)]] if need[r] > 0 else [] for r in range(rows)]
            width = max(len(f) for f in fed)
            ids = np.zeros((rows, width), np.int64)  # [rows, width]; padding slots are masked out
            new_mask = np.zeros((rows, width), np.int64)
            for r, f in enumerate(fed):
                ids[r, :len(f)], new_mask[r, :len(f)] = f, 1
            step_positions = positions[:, None] + np.arange(width)[None]  # [rows, width]
            first_slot = cache.length
            mask = np.concatenate([mask, new_mask], axis=1)
            # a forward that finishes every row needs no next lookahead: the plain graph is cheaper
            plain = all(len(f) >= n for f, n in zip(fed, need) if n > 0)
            start = time.perf_counter()
            if plain:
                logits, streams = self.draft.forward(cache, ids, mask, step_positions), None
            else:
                logits, streams = self.draft.forward_streaming(cache, ids, mask, step_positions)
            self.counters.busy.append((start, time.perf_counter()))
            self.counters.forwards_since_verdict += 1
            flat = logits.reshape(rows * width, -1)  # [rows * width, vocab]
            flat_contexts = [contexts[r] + fed[r][1:c + 1] for r in range(rows) for c in range(width)] \
                if contexts is not None else None
            picks, q = self.sampler.draft(flat, (step_positions + 1).reshape(-1), flat_contexts)
            tids, tlps = top_k_logprobs(flat, k)
            for r in range(rows):
                if not fed[r]:
                    continue
                at = r * width
                kept = 0
                while kept < len(fed[r]) - 1 and fed[r][kept + 1] == int(picks[at + kept]):
                    kept += 1
                for c in range(kept + 1):
                    made[r].append((int(picks[at + c]), tids[at + c], tlps[at + c], None if q is None else q[at + c]))
                slots[r] += [first_slot + c for c in range(kept + 1)]
                mask[r, first_slot + kept + 1:] = 0  # rejected lookahead and padding: holes in this row
                positions[r] += kept + 1
                last[r] = int(picks[at + kept])
                if contexts is not None:
                    contexts[r] = contexts[r] + [int(picks[at + c]) for c in range(kept + 1)]
                full = streams is not None and kept == len(fed[r]) - 1 and len(fed[r]) == width
                lookahead[r] = greedy_tokens(streams[r]).tolist() if full else []
            message, stop = self._after_forward(batch, message, abandon)
            if stop:
                return message
        self.counters.branches += rows
        for r, branch in enumerate(batch):
            row = made[r][:g]
            self._ready[(branch.depth, branch.token)] = _Ready(
                cache, r, np.array([t for t, *_ in row], np.int64), np.stack([t[1] for t in row]),
                np.stack([t[2] for t in row]), np.asarray(slots[r][:g], np.int64),
                None if q is None else np.stack([t[3] for t in row]))
        return message

    def _poll(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None


class MirrorProposer:
    """The main thread's side of Mirror-SD: posts messages to the draft worker and waits for its windows."""

    mode = "mirror"

    def __init__(self, draft: DraftModel, settings: MirrorSettings = MirrorSettings(), rollout=draft_rollout) -> None:
        self.draft, self.settings, self.rollout = draft, settings, rollout
        self.worker: DraftWorker | None = None
        self._awaiting_window = False
        self._active = False
        self.last_counters = WorkerCounters()
        self._stuck: DraftWorker | None = None  # a stopped worker still inside a draft call (see finish)

    @property
    def counters(self) -> WorkerCounters:
        """The counters of the running worker, or of the last one that finished."""
        return self.worker.counters if self.worker else self.last_counters

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        """Start this generation's worker (one per generation: a finished one leaves no thread behind)."""
        self.finish()
        self._wait_for_stuck()
        self.worker = DraftWorker(self.draft, self.settings, sampler, self.rollout)
        self.worker.start()
        self._awaiting_window, self._active = False, True
        self.worker.inbox.put(_Prefill(list(prompt)))

    def propose(self, committed: list[int], gamma: int) -> Proposal:
        if not self._awaiting_window:
            self.worker.inbox.put(_Propose(list(committed), gamma))
        self._awaiting_window = False
        try:
            reply = self.worker.outbox.get(timeout=self.settings.timeout_s)
        except queue.Empty:
            self._active = False
            raise DraftWorkerError("The draft worker did not deliver a window",
                                   f"no answer within {self.settings.timeout_s:.0f} s (a hung draft device?)",
                                   "check the draft device, or raise the timeout") from None
        if isinstance(reply, _Failed):
            self._active = False
            raise DraftWorkerError("The draft worker failed", f"{type(reply.error).__name__}: {reply.error}",
                                   "see the chained exception; the target itself is unaffected") from reply.error
        if not isinstance(reply, Proposal) or reply.tokens.ndim != 1 or len(reply.tokens) < gamma:
            self._active = False
            raise DraftWorkerError("The draft worker returned a malformed window", f"got {reply!r:.200}",
                                   "this is a bug in the draft graph or worker; please report it")
        return reply

    def exit_callback(self):
        if not self._active or not self.settings.use_exit_head:
            return None
        inbox = self.worker.inbox
        return lambda ids, logprobs: inbox.put(_Exit(ids, logprobs))

    def observe(self, verdict: Verdict, new_tokens: list[int], next_gamma: int) -> None:
        if self._active:
            self.worker.inbox.put(_Verdict(verdict, list(new_tokens), next_gamma))
            self._awaiting_window = True

    def finish(self, timeout: float | None = None) -> None:
        """Stop and join the worker; a worker stuck in a draft call for longer than the timeout is an error."""
        self._active = self._awaiting_window = False
        worker, self.worker = self.worker, None
        if worker is None:
            return
        worker.inbox.put(_Stop())
        worker.join(self.settings.timeout_s if timeout is None else timeout)
        if worker.is_alive():
            self._stuck = worker  # it exits when its call returns (it finds Stop); until then it owns the draft
            raise DraftWorkerError("The draft worker did not stop", "a draft graph call is still running",
                                   "the draft device may be hung; restart the process to free it")
        self.last_counters = worker.counters

    def close(self) -> None:
        self.finish()
        self._wait_for_stuck()

    def _wait_for_stuck(self) -> None:
        """No second worker may touch the draft model while a stuck one may still write to its caches."""
        if self._stuck is None:
            return
        self._stuck.join(self.settings.timeout_s)
        if self._stuck.is_alive():
            raise DraftWorkerError("The previous draft worker is still inside a draft call",
                                   f"it has not returned for {self.settings.timeout_s:g} s more, and a new worker "
                                   "would share the draft model with it",
                                   "the draft device may be hung: retry later, use mode 'ar', or restart the process")
        self._stuck = None
