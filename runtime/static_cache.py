"""The host side of the static-shape draft (``draft_static``, see export/graphs/draft_static.py).

    StaticKVCache      a KV cache whose buffers never grow: N slots per layer, all of them fed every call
    StaticDraftModel   DraftModel on the static graph: feeds W tokens per call, builds the fixed [B, N + W] mask
                       from the dynamic-style one, writes the returned new slots at the cache's length

The decoders (SerialDraft, Mirror-SD's worker) use it exactly like DraftModel: same methods, same mask semantics
(1 = attend; holes allowed), rollback is still a length change.
"""
from __future__ import annotations

import numpy as np

from mirrorsd import names
from mirrorsd.errors import GenerationInputError
from mirrorsd.manifest import KVSpec
from mirrorsd.runtime.kv_cache import KVCache
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.session import GraphSession


class StaticKVCache(KVCache):
    """[batch, kv_heads, N, head_dim] buffers of fixed capacity N; slots [0, length) are filled."""

    def __init__(self, spec: KVSpec, batch: int, capacity: int) -> None:
        super().__init__(spec, batch, capacity)
        self.fixed_capacity = capacity

    def past_feeds(self) -> dict[str, np.ndarray]:
        feeds = {}
        for (k_name, v_name), keys, values in zip(self._past_names, self.keys, self.values):
            feeds[k_name], feeds[v_name] = keys, values  # every slot; the mask hides those past ``length``
        return feeds

    def append_presents(self, outputs: dict[str, np.ndarray], new: int) -> None:
        """Write the ``new`` slots the static graph returned (its present holds the new slots only)."""
        self.reserve(self.length + new)
        start, end = self.length, self.length + new
        for (k_name, v_name), keys, values in zip(self._present_names, self.keys, self.values):
            keys[:, :, start:end] = outputs[k_name][:, :, :new]
            values[:, :, start:end] = outputs[v_name][:, :, :new]
        self.length = end

    def reserve(self, slots: int) -> None:
        if slots > self.fixed_capacity:
            raise GenerationInputError(
                f"The static draft's KV buffer is full ({self.fixed_capacity} slots, {slots} needed)",
                "its capacity was fixed at export time (--max-context)",
                "generate fewer tokens, or re-export with a larger --max-context")

    def tiled(self, rows: int, extra: int) -> "StaticKVCache":
        self.reserve(self.length + extra)
        out = StaticKVCache(self.spec, rows, self.fixed_capacity)
        for src, dst in ((self.keys, out.keys), (self.values, out.values)):
            for s, d in zip(src, dst):
                d[:, :, : self.length] = s[0:1, :, : self.length]
        out.length = self.length
        return out


class StaticDraftModel(DraftModel):
    """DraftModel on the fixed-shape graph: N-slot buffers, W tokens per call (more tokens = more calls)."""

    def __init__(self, session: GraphSession) -> None:
        super().__init__(session)
        shapes = session.spec.static_shapes
        self.capacity = shapes[names.PAST_SEQUENCE]
        self.width = shapes[names.SEQUENCE]
        self.cache = StaticKVCache(session.spec.kv, 1, self.capacity)

    def reset(self, capacity: int = 0) -> None:
        self.cache = StaticKVCache(self.session.spec.kv, 1, self.capacity)
        self.cache_tokens = []
        self._agreed = 0

    def check_room(self, tokens: int, gamma: int) -> None:
        """Prompt + new tokens (``tokens``) plus the main window and a branch rollout must fit in the buffer."""
        needed = tokens + 2 * gamma
        if needed > self.capacity:
            raise GenerationInputError(
                f"The static draft holds {self.capacity} tokens; this request may need {needed}",
                "prompt + max_new_tokens + 2 x gamma must fit in its fixed KV buffer",
                "shorten the prompt or max_new_tokens, or re-export with a larger --max-context")

    def forward(self, cache: StaticKVCache, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                logits_from: int = 0) -> np.ndarray:
        """ids [B, S] -> logits [B, S, vocab]; ``mask`` [B, length + S] as for the dynamic draft. The fixed-shape
        graph scores every row (``logits_from`` is for graphs that can skip some)."""
        rows, total = ids.shape
        width, n = self.width, self.capacity
        pieces = []
        for start in range(0, total, width):
            take = min(width, total - start)
            length = cache.length
            cache.reserve(length + take)
            step_ids = np.zeros((rows, width), np.int64)
            step_pos = np.zeros((rows, width), np.int64)
            step_mask = np.zeros((rows, n + width), np.int64)  # [buffer slots | new tokens]
            step_ids[:, :take] = ids[:, start:start + take]
            step_pos[:, :take] = positions[:, start:start + take]
            step_pos[:, take:] = step_pos[:, take - 1:take] + np.arange(1, width - take + 1)
            step_mask[:, :length] = mask[:, :length]
            step_mask[:, n:n + take] = mask[:, length:length + take]
            feeds = {self.session.first_input: step_ids, names.ATTENTION_MASK: step_mask,
                     names.POSITION_IDS: step_pos}
            feeds.update(cache.past_feeds())
            out = self.session.run(feeds)
            logits = out[self._logits_name]
            if logits.shape[:2] != (rows, width):
                raise ValueError(f"static draft returned logits of shape {logits.shape} for inputs {step_ids.shape}")
            cache.append_presents(out, take)
            pieces.append(logits[:, :take])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)


def draft_model(session: GraphSession) -> DraftModel:
    """The draft wrapper for ``session``'s graph: static when its manifest entry has fixed shapes."""
    return StaticDraftModel(session) if session.spec.static_shapes else DraftModel(session)
