"""The target (prefix -> exit head -> suffix) and the draft, each driving its graphs and KV caches.

Position ids are the logical positions of the tokens (left padding excluded); attention masks cover every cache
slot plus the new tokens. Holes (mask 0) are allowed anywhere: padding, or slots of branches not taken.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from mirrorsd import names
from mirrorsd.devices.kernels.logits_rows import LOGITS_FROM
from mirrorsd.runtime.kv_cache import KVCache
from mirrorsd.runtime.limits import check_finite
from mirrorsd.runtime.session import GraphSession
from mirrorsd.runtime.state_cache import target_cache
from mirrorsd.runtime.verify import candidate_logprobs, exit_candidates
from mirrorsd.runtime.view_cache import ViewCache

ExitCallback = Callable[[np.ndarray, np.ndarray], None]  # (topk_ids [S, k], topk_logprobs [S, k])
# A prompt longer than one chunk reports before its first chunk and after each: (model "target" or "draft", tokens
# read, prompt tokens)
PrefillCallback = Callable[[str, int, int], None]
# Prompt tokens per forward when a prompt is read (prefill), in both models; the C++ library (runtime/native) uses the
# same number. One forward over a whole long prompt asks for its attention scores [heads, S, S] and its logits
# [S, vocab] at once: ~1.8 GB of logits and 0.4 GB of scores per layer at 3,000 tokens for the 1.5B Qwen target,
# more than this machine's memory at 30,000 (within its context). In chunks the peak stays that of 256 tokens, and
# every chunk's rows are what a verification window of the same tokens computes.
PREFILL_CHUNK = 256
# A callback may carry ``draft_top`` (ids [g, k], the draft's own top-k at each window position): with a sparse exit
# head (exit_sparse.onnx) only those tokens are scored, instead of the whole vocabulary (verify.exit_candidates).


def single_row_inputs(tokens: np.ndarray, past: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [1, S], mask [1, past + S], positions [1, S] for one unpadded sequence continuing at ``past``."""
    s = len(tokens)
    ids = np.asarray(tokens, np.int64).reshape(1, s)
    mask = np.ones((1, past + s), np.int64)
    positions = np.arange(past, past + s, dtype=np.int64).reshape(1, s)
    return ids, mask, positions


def report(callback: PrefillCallback | None, model: str, read: int, total: int, chunk: int) -> None:
    """Tell ``callback`` how much of a prompt of more than one chunk ``model`` has read."""
    if callback is not None and total > chunk:
        callback(model, min(read, total), total)


def logits_from_feed(session: GraphSession, first: int) -> dict[str, np.ndarray]:
    """The ``logits_from`` input of a graph rewritten to take it (devices/kernels/logits_rows.py): its LM head scores
    rows ``first`` on; nothing for a graph as exported, which scores every row."""
    return {LOGITS_FROM: np.array([first], np.int64)} if session.logits_from else {}


def cache_feeds(cache, new: int) -> dict[str, np.ndarray]:
    """What a graph's cache feeds for a call adding ``new`` slots: a view cache's views span them
    (runtime/view_cache.py), every other cache feeds its past."""
    step_feeds = getattr(cache, "step_feeds", None)
    return step_feeds(new) if step_feeds is not None else cache.past_feeds()


class TargetModel:
    """The split target: prefix graph, early-exit head, suffix graph, and the KV caches of both halves.

    ``cache``: "present" (the graphs' presents kept as the cache, no copies; runtime/present_cache.py) or "buffer"
    (a preallocated buffer; scripts/lab/target_step_cost.py --cache buffer measures the difference). A stateful backend
    keeps its own cache whatever this says (runtime/state_cache.py).
    """

    def __init__(self, prefix: GraphSession, exit_head: GraphSession, suffix: GraphSession,
                 cache: str = "present", exit_sparse: GraphSession | None = None) -> None:
        self.prefix, self.exit_head, self.suffix, self.exit_sparse = prefix, exit_head, suffix, exit_sparse
        self._cache = cache
        self.prefix_cache = target_cache(prefix, kind=cache)
        self.suffix_cache = target_cache(suffix, kind=cache)
        self._hidden_name = prefix.output_names[0]
        self._logits_name = suffix.output_names[0]
        self._topk_ids, self._topk_logprobs = exit_head.output_names[:2]
        self.on_prefill: PrefillCallback | None = None  # progress of a long prompt (mirrorsd generate's bar)

    @property
    def length(self) -> int:
        return self.prefix_cache.length

    def reset(self, batch: int = 1, capacity: int = 64) -> None:
        """Empty caches for ``batch`` rows; ``capacity`` sizes a buffer cache (a present cache grows as it goes)."""
        self.prefix_cache = target_cache(self.prefix, batch, capacity, self._cache)
        self.suffix_cache = target_cache(self.suffix, batch, capacity, self._cache)

    def truncate(self, length: int) -> None:
        self.prefix_cache.truncate(length)
        self.suffix_cache.truncate(length)

    def forward(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                on_exit: ExitCallback | None = None) -> np.ndarray:
        """ids [B, S] -> logits [B, S, vocab]; appends S slots to both caches.

        With ``on_exit`` the exit head runs on the prefix's hidden state before the suffix starts, and its top-k
        (batch row 0) is handed over at once: this is the early-exit message of Mirror-SD.
        """
        return self._forward(ids, mask, positions, on_exit)[1]

    def extend_with_hidden(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """Single sequence: (hidden state at the exit layer [S, H], logits [S, vocab]) of ``tokens`` fed after the
        cached ones (the exit adapter's training data)."""
        hidden, logits = self._forward(*single_row_inputs(tokens, self.length), None)
        return hidden[0], logits[0]

    def _forward(self, ids, mask, positions, on_exit, logits_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(hidden [B, S, H], logits [B, S, vocab]; rows from ``logits_from`` on where the suffix graph takes it)."""
        new = ids.shape[1]
        feeds = {self.prefix.first_input: ids, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        feeds.update(cache_feeds(self.prefix_cache, new))
        out = self.prefix.run(feeds)
        self.prefix_cache.append_presents(out, new)
        hidden = out[self._hidden_name]  # [B, S, H]
        if on_exit is not None:
            on_exit(*self._exit_message(hidden, getattr(on_exit, "draft_top", None)))
        feeds = {self.suffix.first_input: hidden, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        feeds.update(cache_feeds(self.suffix_cache, new))
        feeds.update(logits_from_feed(self.suffix, logits_from))
        out = self.suffix.run(feeds)
        self.suffix_cache.append_presents(out, new)
        return hidden, check_finite(out[self._logits_name])

    def _exit_message(self, hidden: np.ndarray, draft_top: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The early exit's (ids [S, k], log-probs [S, k]) for batch row 0: the sparse head over the draft's
        candidates when the folder has one and the draft listed candidates, else the full head's top-k."""
        if self.exit_sparse is not None and draft_top is not None and draft_top.size:
            candidates = exit_candidates(draft_top, hidden.shape[1])  # [S, m], -1 = none
            names_in = self.exit_sparse.input_names
            out = self.exit_sparse.run({names_in[0]: hidden[:1], names_in[1]: np.maximum(candidates, 0)[None]})
            return candidate_logprobs(candidates, out[self.exit_sparse.output_names[0]][0])
        head = self.exit_head.run({self.exit_head.first_input: hidden})
        return head[self._topk_ids][0], head[self._topk_logprobs][0]

    def extend(self, tokens, on_exit: ExitCallback | None = None) -> np.ndarray:
        """Single sequence: feed ``tokens`` after the cached ones; returns logits [S, vocab]."""
        ids, mask, positions = single_row_inputs(tokens, self.length)
        return self.forward(ids, mask, positions, on_exit)[0]

    def prefill(self, tokens, chunk: int | None = None) -> np.ndarray:
        """Single sequence: feed ``tokens`` (a prompt) after the cached ones, PREFILL_CHUNK at a time; returns the
        logits of the last one [1, vocab]."""
        chunk = chunk or PREFILL_CHUNK
        logits = None
        report(self.on_prefill, "target", 0, len(tokens), chunk)  # a bar's clock starts with the first chunk
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            # only the last row's logits are used: a graph that can scores that row alone ([1 or S, vocab])
            logits = self._forward(*single_row_inputs(part, self.length), None, len(part) - 1)[1][0]
            report(self.on_prefill, "target", start + chunk, len(tokens), chunk)
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits[-1:]


class DraftModel:
    """The draft graph with its main KV cache; branch rollouts pass caches of their own."""

    def __init__(self, session: GraphSession) -> None:
        self.session = session
        self.cache = draft_cache(session)
        self.cache_tokens: list[int] = []  # the tokens whose KV fills cache slots [0, length)
        self._agreed = 0  # cache_tokens[:_agreed] is known to be committed (committed text never changes)
        self._logits_name = session.output_names[0]
        width = session.spec.outputs[0].shape[-1]  # the vocabulary, fixed in the manifest
        self._vocab = width if isinstance(width, int) else None
        self.on_prefill: PrefillCallback | None = None  # progress of a long prompt (mirrorsd generate's bar)

    def reset(self, capacity: int = 64) -> None:
        self.cache = draft_cache(self.session, capacity)
        self.cache_tokens = []
        self._agreed = 0

    def forward(self, cache: KVCache | ViewCache, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                logits_from: int = 0) -> np.ndarray:
        """ids [B, S] -> logits [B, S, vocab] (rows from ``logits_from`` on where the graph takes it: a prompt's
        chunk, whose logits are not read); appends S slots to ``cache``."""
        feeds = {self.session.first_input: ids, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        feeds.update(cache_feeds(cache, ids.shape[1]))
        feeds.update(logits_from_feed(self.session, logits_from))
        out = self.session.run(feeds)
        logits = out[self._logits_name]
        rows = ids.shape[1] - logits_from if self.session.logits_from else ids.shape[1]
        if logits.ndim != 3 or logits.shape[:2] != (ids.shape[0], rows) or self._vocab not in (None, logits.shape[2]):
            raise ValueError(f"draft returned logits of shape {logits.shape} for inputs {ids.shape}")
        cache.append_presents(out, ids.shape[1])
        return logits

    def sync_to(self, committed: list[int]) -> list[int]:
        """Roll the main cache back to its longest prefix that is still committed; return the tokens to feed.

        ``committed`` must only ever grow between calls (it is the committed text, never a speculative one).
        """
        keep = common_prefix(self.cache_tokens, committed, self._agreed)
        self._agreed = keep
        self.cache.truncate(keep)
        del self.cache_tokens[keep:]
        return committed[keep:]

    def extend(self, tokens: list[int], last_only: bool = False) -> np.ndarray:
        """Feed ``tokens`` to the main cache; logits [S, vocab] (``last_only``: the last row's, [1, vocab], where the
        graph can score it alone)."""
        ids, mask, positions = single_row_inputs(tokens, self.cache.length)
        logits = self.forward(self.cache, ids, mask, positions, len(tokens) - 1 if last_only else 0)[0]
        self.cache_tokens.extend(int(t) for t in tokens)
        return logits

    def prefill(self, tokens: list[int], chunk: int | None = None) -> None:
        """Feed ``tokens`` (a prompt) to the main cache, PREFILL_CHUNK at a time; their logits are not kept."""
        chunk = chunk or PREFILL_CHUNK
        report(self.on_prefill, "draft", 0, len(tokens), chunk)
        for start in range(0, len(tokens), chunk):
            self.extend(tokens[start:start + chunk], last_only=True)
            report(self.on_prefill, "draft", start + chunk, len(tokens), chunk)

    def keep_prefix(self, tokens: list[int]) -> int:
        """Start a new text: keep the main-cache slots whose tokens begin ``tokens`` (a shared system prompt, an
        earlier turn of the conversation, the text mode auto's ar probe read), drop the rest; returns how many
        were kept. A slot's KV depends only on the tokens up to it, so the kept ones are what a prefill would write."""
        keep = common_prefix(self.cache_tokens, tokens)
        if keep:
            self.truncate(keep)
        return keep

    def truncate(self, length: int) -> None:
        """Drop main-cache slots from ``length`` on."""
        self.cache.truncate(length)
        del self.cache_tokens[length:]
        self._agreed = min(self._agreed, length)

    def holds(self, start: int, tokens: list[int]) -> None:
        """Record that main-cache slots [start, length) now hold ``tokens`` (a rollout or an adopted branch wrote
        them; the slots before ``start`` are unchanged)."""
        if start + len(tokens) != self.cache.length or start > len(self.cache_tokens):
            raise ValueError(f"the draft cache holds {self.cache.length} slots, not {start} + {len(tokens)}")
        del self.cache_tokens[start:]
        self.cache_tokens.extend(tokens)
        self._agreed = min(self._agreed, start)


def draft_cache(session: GraphSession, capacity: int = 64) -> KVCache | ViewCache:
    """An empty one-row cache for the draft's graph: buffers it writes in place when its session was rewritten so
    (runtime/view_cache.py), else buffers the graph's presents are copied into (KVCache)."""
    layers = getattr(session.backend, "kv_in_place", None)
    return ViewCache(layers, 1, capacity) if layers else KVCache(session.spec.kv, 1, capacity)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` items are known equal."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
