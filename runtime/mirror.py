"""Mirror-SD: the draft rolls out branches on its own thread while the target verifies the current window.

    main thread (target device)                     draft worker (draft device)
    ---------------------------                     ---------------------------
    propose(): wait for a window        <-- Window --  fresh rollout, or a ready branch
    prefix([last] + window)                          extend: one forward on the window's last token
    exit head -> top-k per position     -- Exit ---> rank candidate branches (draft runner-ups + the exit;
                                                     with the exit head on, the first batch waits for it)
    suffix -> target tokens -> verdict               roll out branches (d, v) in batches, best first,
    observe(verdict)                    -- Verdict->   until the verdict arrives or the cap is reached
                                                     branch (A+1, c) ready? adopt its KV + tokens (reuse)
                                                     else roll out afresh (fallback)
Only token ids and log-probs cross between the threads (and, for the residual sampling rule, each window's q).
Every window comes from the rollout engine (rollout.py): a branch's window is the one a fresh rollout after the
verdict would draw, so reuse never changes the tokens, whatever the timing. The worker owns the draft model and its
caches. A worker failure reaches the caller as DraftWorkerError; nothing busy-waits (the worker polls its inbox
only between draft forwards, and blocks when it has nothing to do).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace

import numpy as np

from mirrorsd.errors import DraftWorkerError
from mirrorsd.runtime.config import MirrorSettings
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.ngram import NgramIndex, NgramSettings
from mirrorsd.runtime.rollout import Window, adopt, branches, fresh
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.verify import AcceptanceEstimate, Verdict, rank_branches, top_k_logprobs


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


@dataclass(frozen=True)
class _ExitHandoff:
    """The exit callback the target runs: posts the early exit to the worker. ``draft_top`` (the current window's
    draft top-k, [g, k]) is what a sparse exit head scores (models.TargetModel)."""

    inbox: queue.Queue
    draft_top: np.ndarray | None

    def __call__(self, ids: np.ndarray, logprobs: np.ndarray) -> None:
        self.inbox.put(_Exit(ids, logprobs))


class _Stop:
    """Generation over (or failed): the worker drops what it was doing and exits."""


# Messages (worker -> main)
@dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclass
class WorkerCounters:
    branches: int = 0
    forwards_since_verdict: int = 0


class DraftWorker(threading.Thread):
    """Owns the draft model; answers each verdict with the next window (all of them from the rollout engine)."""

    def __init__(self, draft: DraftModel, settings: MirrorSettings, sampler: Sampler = GREEDY,
                 lookahead: bool = False, lookup: NgramSettings | None = None) -> None:
        super().__init__(name="mirrorsd-draft", daemon=True)
        self.draft, self.settings, self.sampler, self.lookahead = draft, settings, sampler, lookahead
        self.lookup = NgramIndex(lookup) if lookup is not None else None  # guesses for fresh windows (ngram.py)
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.committed: list[int] = []
        self.counters = WorkerCounters()
        self._ready: dict[tuple[int, int], Window] = {}  # branches rolled out for the current window, by (d, v)
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
            kept = self.draft.keep_prefix(self.committed)  # slots the last text shares with this one stay
            if not kept:
                self.draft.reset(capacity=len(message.tokens) + 64)
            if kept < len(self.committed):
                self.draft.prefill(self.committed[kept:])  # the rest of the prompt
            return self.inbox.get()
        if isinstance(message, _Propose):
            self.committed = list(message.committed)
            window = self._fresh(message.gamma)
            while True:
                forwards, self.counters.forwards_since_verdict = self.counters.forwards_since_verdict, 0
                self.outbox.put(replace(window, forwards=forwards, kv=None))
                message = self._speculate(window)
                if not isinstance(message, _Verdict):
                    break
                window = self._next_window(message)
            return message
        return self.inbox.get()  # a stale exit message

    # ---- windows -----------------------------------------------------------------------------------------
    def _fresh(self, gamma: int) -> Window:
        guess = None
        if self.lookup is not None:  # a miss drafts afresh: a prompt-lookup guess as lookahead saves forwards
            self.lookup.sync(self.committed)
            guess = self.lookup.lookup(gamma - 1)
        window = fresh(self.draft, self.committed, gamma, self.sampler, self.settings.runner_up_k, self.lookahead,
                       guess)
        self.counters.forwards_since_verdict += window.forwards
        return window

    def _next_window(self, message: _Verdict) -> Window:
        """Apply a verdict: adopt the branch it hits if that one is ready, else draft afresh."""
        self.acceptance.update(message.verdict)
        self.committed.extend(message.new_tokens)
        ready = self._ready.get(message.verdict.branch)
        self._ready = {}
        if ready is not None and len(ready.tokens) >= message.gamma:
            window = replace(ready.cut(message.gamma), reused=True)
            adopt(self.draft, window, self.committed)
            return window
        return self._fresh(message.gamma)

    # ---- speculation -------------------------------------------------------------------------------------
    def _speculate(self, window: Window):
        """Roll out branches of ``window`` until a verdict (or End/Stop) must be answered; return that message."""
        self._ready = {}
        cap_mode = self.settings.branch_budget == "cap"
        exit_msg, held, candidates = None, None, None
        spent: set[tuple[int, int]] = set()
        message = self._poll()
        while True:
            if isinstance(message, _Exit):
                exit_msg = message
            elif isinstance(message, _Verdict) and cap_mode:
                held = message
            elif message is not None:
                return message
            if candidates is None:
                candidates = self._extend_last(window)
                message = self._poll()
                if message is None and exit_msg is None and self.settings.exit_head:
                    message = self.inbox.get()  # the early exit is on its way: the first branches are ranked with it
                continue
            batch = []
            if len(spent) < self.settings.branches:
                room = min(self.settings.branch_batch, self.settings.branches - len(spent))
                batch = rank_branches(window.tokens, *candidates, exit_msg.ids if exit_msg else None,
                                      exit_msg.logprobs if exit_msg else None, self.acceptance.rate,
                                      frozenset(spent), room)
            if batch:
                spent.update((b.depth, b.token) for b in batch)
                message = self._roll_out(window, batch, abandon=not cap_mode)
            elif held is not None:
                return held
            else:
                message = self.inbox.get()  # nothing left worth doing: block until told

    def _extend_last(self, window: Window) -> tuple[np.ndarray, np.ndarray]:
        """One forward on the window's last token: the draft's own candidates after a fully accepted window.
        Returns its top-k at every window position and after it (ids, log-probs [g + 1, k])."""
        # The main cache holds exactly committed + window[:-1] here (fresh rollout or adopted branch).
        logits = self.draft.extend([int(window.tokens[-1])])
        self.counters.forwards_since_verdict += 1
        ids, lps = top_k_logprobs(logits[-1:], self.settings.runner_up_k)
        return np.concatenate([window.top_ids, ids]), np.concatenate([window.top_logprobs, lps])

    def _roll_out(self, window: Window, batch, abandon: bool) -> object | None:
        """Roll out ``batch`` branches together, one row each. Returns a message that arrived meanwhile."""
        message = None

        def between() -> bool:  # after every draft forward: poll; stop when the verdict wants another branch
            nonlocal message
            self.counters.forwards_since_verdict += 1
            if message is not None:
                return False
            message = self._poll()
            if isinstance(message, _Verdict):
                return abandon and not any((b.depth, b.token) == message.verdict.branch for b in batch)
            return message is not None and not isinstance(message, _Exit)

        rows = branches(self.draft, self.committed, window.tokens, batch, self.sampler, self.settings.runner_up_k,
                        self.lookahead, between)
        if rows is not None:
            self.counters.branches += len(batch)
            self._ready.update({(b.depth, b.token): row for b, row in zip(batch, rows)})
        return message

    def _poll(self):
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None


class MirrorProposer:
    """The main thread's side of Mirror-SD: posts messages to the draft worker and waits for its windows."""

    mode = "mirror"

    def __init__(self, draft: DraftModel, settings: MirrorSettings = MirrorSettings(), lookahead: bool = False,
                 lookup: NgramSettings | None = None) -> None:
        self.draft, self.settings, self.lookahead = draft, settings, lookahead  # lookahead: a streaming draft
        self.lookup = lookup  # prompt lookup's guesses for the worker's fresh windows (None: none)
        self.worker: DraftWorker | None = None
        self._awaiting_window = False
        self._active = False
        self.last_counters = WorkerCounters()
        self._stuck: DraftWorker | None = None  # a stopped worker still inside a draft call (see finish)
        self._draft_top: np.ndarray | None = None  # the last window's draft top-k (a sparse exit head's candidates)

    @property
    def counters(self) -> WorkerCounters:
        """The counters of the running worker, or of the last one that finished."""
        return self.worker.counters if self.worker else self.last_counters

    def reset(self, prompt: list[int], sampler: Sampler = GREEDY) -> None:
        """Start this generation's worker (one per generation: a finished one leaves no thread behind)."""
        self.finish()
        self._wait_for_stuck()
        self.worker = DraftWorker(self.draft, self.settings, sampler, self.lookahead, self.lookup)
        self.worker.start()
        self._awaiting_window, self._active = False, True
        self.worker.inbox.put(_Prefill(list(prompt)))

    def propose(self, committed: list[int], gamma: int) -> Window:
        if not self._awaiting_window:
            self.worker.inbox.put(_Propose(list(committed), gamma))
        self._awaiting_window = False
        try:
            reply = self.worker.outbox.get(timeout=self.settings.draft_wait_s)
        except queue.Empty:
            self._active = False
            raise DraftWorkerError("The draft worker did not deliver a window",
                                   f"no answer within {self.settings.draft_timeout_s:.0f} s (a hung draft device?)",
                                   "check the draft device, or raise the timeout") from None
        if isinstance(reply, _Failed):
            self._active = False
            raise DraftWorkerError("The draft worker failed", f"{type(reply.error).__name__}: {reply.error}",
                                   "see the chained exception; the target itself is unaffected") from reply.error
        if not isinstance(reply, Window) or reply.tokens.ndim != 1 or len(reply.tokens) < gamma:
            self._active = False
            raise DraftWorkerError("The draft worker returned a malformed window", f"got {reply!r:.200}",
                                   "this is a bug in the draft graph or worker; please report it")
        self._draft_top = reply.top_ids
        return reply

    def exit_callback(self):
        if not self._active or not self.settings.exit_head:
            return None
        return _ExitHandoff(self.worker.inbox, self._draft_top)

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
        worker.join(self.settings.draft_wait_s if timeout is None else timeout)
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
        self._stuck.join(self.settings.draft_wait_s)
        if self._stuck.is_alive():
            raise DraftWorkerError("The previous draft worker is still inside a draft call",
                                   f"it has not returned for {self.settings.draft_timeout_s:g} s more, and a new "
                                   "worker would share the draft model with it",
                                   "the draft device may be hung: retry later, use mode 'ar', or restart the process")
        self._stuck = None
