"""KV cache = preallocated buffers + a length. Rolling back a rejected draft is a length change, never a re-run.

Buffers are [batch, kv_heads, capacity, head_dim] per layer; slots [0, length) are filled. Capacity grows by
doubling when a step needs more room.
"""
from __future__ import annotations

import numpy as np

from mirrorsd.manifest import KVSpec

MIN_CAPACITY = 64


class KVCache:
    def __init__(self, spec: KVSpec, batch: int = 1, capacity: int = MIN_CAPACITY) -> None:
        self.spec = spec
        self.layers = list(spec.layer_indices())
        shape = (batch, spec.num_kv_heads, max(capacity, 1), spec.head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in self.layers]
        self.values = [np.zeros(shape, np.float32) for _ in self.layers]
        self.length = 0
        self._past_names = [(spec.past_key % i, spec.past_value % i) for i in self.layers]
        self._present_names = [(spec.present_key % i, spec.present_value % i) for i in self.layers]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 1 << 30

    def past_feeds(self) -> dict[str, np.ndarray]:
        feeds = {}
        for (k_name, v_name), keys, values in zip(self._past_names, self.keys, self.values):
            feeds[k_name] = keys[:, :, : self.length]  # [B, H, length, D]
            feeds[v_name] = values[:, :, : self.length]
        return feeds

    def append_presents(self, outputs: dict[str, np.ndarray], new: int) -> None:
        """Copy the ``new`` slots a graph appended (its present = past + new) into the buffers."""
        self.reserve(self.length + new)
        start, end = self.length, self.length + new
        for (k_name, v_name), keys, values in zip(self._present_names, self.keys, self.values):
            keys[:, :, start:end] = outputs[k_name][:, :, start:end]
            values[:, :, start:end] = outputs[v_name][:, :, start:end]
        self.length = end

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        capacity = max(slots, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = np.zeros(old.shape[:2] + (capacity,) + old.shape[3:], np.float32)
                grown[:, :, : self.length] = old[:, :, : self.length]
                buffers[i] = grown

    def tiled(self, rows: int, extra: int) -> "KVCache":
        """A ``rows``-row copy of row 0's filled slots, with room for ``extra`` more (branch rollouts)."""
        out = KVCache(self.spec, rows, self.length + extra)
        for src, dst in ((self.keys, out.keys), (self.values, out.values)):
            for s, d in zip(src, dst):
                d[:, :, : self.length] = s[0:1, :, : self.length]
        out.length = self.length
        return out

    def adopt_slots(self, other: "KVCache", row: int, slots: np.ndarray, dst_start: int) -> None:
        """Copy ``other``'s ``row`` at the given slot indices (in order; a streamed branch row has holes between
        them) into row 0 here, contiguous from ``dst_start``; slots after them are dropped."""
        count = len(slots)
        self.truncate(dst_start)
        self.reserve(dst_start + count)
        for src, dst in ((other.keys, self.keys), (other.values, self.values)):
            for s, d in zip(src, dst):
                d[0, :, dst_start:dst_start + count] = s[row][:, slots]  # [H, count, D]
        self.length = dst_start + count

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)
