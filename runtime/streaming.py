"""Speculative Streaming at decode time: the draft's streaming graph beside its plain one.

    draft_streaming.onnx   ids [B, S] -> main logits [B, S, vocab] (as draft.onnx) + stream logits [B, n, vocab]:
                           the n tokens after the last input column, guessed in the same forward
    cache                  one KV cache for both graphs (streams keep no KV)

How a rollout uses the streams as lookahead (fed, checked by the draft's own picks, kept or dropped) is the
rollout engine's business (rollout.py, ``lookahead=True``): the windows stay the draft's own picks, and only the
number of draft forwards (``stats.draft_forwards``) changes.
"""
from __future__ import annotations

import numpy as np

from mirrorsd import names
from mirrorsd.runtime.models import DraftModel, cache_feeds
from mirrorsd.runtime.session import GraphSession


class StreamingDraftModel(DraftModel):
    """The draft with its streaming graph beside the plain one; both read and extend the same main cache."""

    def __init__(self, session: GraphSession, streaming: GraphSession) -> None:
        super().__init__(session)
        self.streaming = streaming
        self._main_name, self._stream_name = streaming.output_names[:2]  # logits, stream_logits (manifest order)
        self.streams = int(streaming.spec.outputs[1].shape[1])

    def forward_streaming(self, cache, ids: np.ndarray, mask: np.ndarray,
                          positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids [B, S] -> (main logits [B, S, vocab], stream logits [B, n, vocab], hung on input column S - 1);
        appends S slots to ``cache`` (any cache of this draft: the main one or a branch batch's)."""
        feeds = {self.streaming.first_input: ids, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        feeds.update(cache_feeds(cache, ids.shape[1]))
        out = self.streaming.run(feeds)
        logits, streams = out[self._main_name], out[self._stream_name]
        if logits.shape[:2] != ids.shape or streams.shape[:2] != (ids.shape[0], self.streams):
            raise ValueError(f"streaming draft returned {logits.shape} / {streams.shape} for inputs {ids.shape}")
        cache.append_presents(out, ids.shape[1])
        return logits, streams


def streaming_draft(sessions: dict[str, GraphSession]) -> StreamingDraftModel | None:
    """The streaming draft when ``sessions`` hold its graph (an export from a mirrorsd-train-draft folder)."""
    streaming = sessions.get(names.DRAFT_STREAMING)
    return StreamingDraftModel(sessions[names.DRAFT], streaming) if streaming is not None else None
