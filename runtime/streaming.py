"""Speculative Streaming at decode time: every draft forward checks the previous lookahead and proposes the next.

    forward:  feed [last] + lookahead (l <= n tokens) through draft_streaming.onnx
              main rows -> the draft's own picks a_1 .. a_(l+1) (the sampler's; greedy: argmax)
              keep the longest lookahead prefix equal to a_1 .. a_m, then a_(m+1)       -> m + 1 window tokens
              stream rows (hung on the last fed token) -> the next lookahead, valid only when m = l; after a
              miss the next forward feeds the pick alone and gets a fresh lookahead
    cache:    one KV cache for both graphs (streams keep no KV); rejected lookahead slots are a length change
    plain:    a forward that may finish the window needs no next lookahead and runs draft.onnx (no stream rows)
    cost:     a g-token window takes 1 + ceil((g - 1) / (n + 1)) forwards when every lookahead holds, g at worst
Every window token is the main stream's own pick at its position, so a window equals ``draft_rollout``'s (up to
float noise between the two graphs): acceptance by the target, and the output, do not change, only the number of
draft forwards (``stats.draft_forwards``).
"""
from __future__ import annotations

import numpy as np

from mirrorsd import names
from mirrorsd.runtime.models import DraftModel, single_row_inputs
from mirrorsd.runtime.proposers import Rollout, SerialDraft
from mirrorsd.runtime.sampling import GREEDY, Sampler
from mirrorsd.runtime.session import GraphSession
from mirrorsd.runtime.verify import greedy_tokens, top_k_logprobs


class StreamingDraftModel(DraftModel):
    """The draft with its streaming graph beside the plain one; both read and extend the same main cache."""

    def __init__(self, session: GraphSession, streaming: GraphSession) -> None:
        super().__init__(session)
        self.streaming = streaming
        self._main_name, self._stream_name = streaming.output_names[:2]  # logits, stream_logits (manifest order)
        self.streams = int(streaming.spec.outputs[1].shape[1])

    def extend_streaming(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Feed ``tokens`` to the main cache: (main logits [S, vocab], stream logits [n, vocab])."""
        ids, mask, positions = single_row_inputs(tokens, self.cache.length)
        logits, streams = self.forward_streaming(self.cache, ids, mask, positions)
        self.cache_tokens.extend(int(t) for t in tokens)
        return logits[0], streams[0]

    def forward_streaming(self, cache, ids: np.ndarray, mask: np.ndarray,
                          positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [B, S] -> (main logits [B, S, vocab], stream logits [B, n, vocab], hung on input column S - 1);
        appends S slots to ``cache`` (any cache of this draft: the main one or a branch batch's)."""
        feeds = {self.streaming.first_input: ids, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        feeds.update(cache.past_feeds())
        out = self.streaming.run(feeds)
        logits, streams = out[self._main_name], out[self._stream_name]
        if logits.shape[:2] != ids.shape or streams.shape[:2] != (ids.shape[0], self.streams):
            raise ValueError(f"streaming draft returned {logits.shape} / {streams.shape} for inputs {ids.shape}")
        cache.append_presents(out, ids.shape[1])
        return logits, streams

    def truncate(self, length: int) -> None:
        """Drop cache slots from ``length`` on (rejected lookahead tokens)."""
        self.cache.truncate(length)
        del self.cache_tokens[length:]
        self._agreed = min(self._agreed, length)


def streaming_rollout(draft: StreamingDraftModel, committed: list[int], gamma: int, top_k: int = 0,
                      sampler: Sampler = GREEDY) -> Rollout:
    """``draft_rollout``'s contract (tokens, top-k, q, forwards) in fewer forwards; the cache ends holding
    committed + window[:-1], as after ``draft_rollout``."""
    pending = draft.sync_to(committed)
    if not pending:  # everything is cached: feed the last committed token again for its logits
        draft.truncate(len(committed) - 1)
        pending = committed[-1:]
    window: list[int] = []
    rows, probs = [], []  # the main-stream logits row behind each window token, and its q (sampling)
    lookahead: list[int] = []
    feed, forwards = list(pending), 0
    while len(window) < gamma:
        need = gamma - len(window)
        lookahead = lookahead[: need - 1]  # a forward yields at most len(lookahead) + 1 tokens
        if len(lookahead) + 1 < need:
            logits, stream_logits = draft.extend_streaming(feed + lookahead)
        else:  # this forward may finish the window: no next lookahead needed, the plain graph is cheaper
            logits, stream_logits = draft.extend(feed + lookahead), None
        forwards += 1
        logits = logits[len(feed) - 1:]  # [l + 1, vocab]: row r picks the token after feed + lookahead[:r]
        start = len(committed) + len(window)
        contexts = [committed + window + lookahead[:r] for r in range(len(logits))] if sampler.needs_context else None
        picks, q = sampler.draft(logits, start + np.arange(len(logits)), contexts)
        kept = 0
        while kept < len(lookahead) and lookahead[kept] == int(picks[kept]):
            kept += 1
        window += [int(t) for t in picks[: kept + 1]]
        rows += list(logits[: kept + 1])
        probs += [] if q is None else list(q[: kept + 1])
        draft.truncate(draft.cache.length - (len(lookahead) - kept))  # rejected lookahead slots
        full = kept == len(lookahead) and stream_logits is not None
        lookahead = greedy_tokens(stream_logits).tolist() if full else []
        feed = [window[-1]]
    ids, lps = top_k_logprobs(np.stack(rows), top_k) if top_k else (np.zeros((gamma, 0)), np.zeros((gamma, 0)))
    return Rollout(np.asarray(window, np.int64), np.asarray(ids, np.int64), np.asarray(lps, np.float32), forwards,
                   np.stack(probs) if probs else None)


class StreamingSerialDraft(SerialDraft):
    """Vanilla speculative decoding (``sd``) with a streaming draft: the same windows, fewer draft forwards."""

    def __init__(self, draft: StreamingDraftModel) -> None:
        super().__init__(draft, streaming_rollout)  # SerialDraft.propose: a failure becomes a DraftWorkerError


def streaming_draft(sessions: dict[str, GraphSession]) -> StreamingDraftModel | None:
    """The streaming draft when ``sessions`` hold its graph (an export from a mirrorsd-train-draft folder)."""
    streaming = sessions.get(names.DRAFT_STREAMING)
    return StreamingDraftModel(sessions[names.DRAFT], streaming) if streaming is not None else None
