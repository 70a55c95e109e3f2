"""The target's KV cache: the graph's own ``present`` outputs and a length, fed back as the next ``past``.

    step:      past [B, H, L, D] --graph: Concat(past, new)--> present [B, H, L + S, D]   (kept as the cache)
    rollback:  length L' < L + S; the next feed is present[:, :, :L'], copied once into a compact array
Why not the draft's KVCache (a preallocated buffer fed as ``buffer[:, :, :length]``): that slice is not contiguous
(heads are ``capacity`` slots apart), so every step copied the whole cache into a contiguous input, and then copied
the new slots out of ``present`` into the buffer. Here a step moves no KV outside the graph when nothing was
rejected (ONNX Runtime hands its output buffers to NumPy without a copy, and takes a contiguous input as is); a
rejection costs one copy of the kept slots. The target never has holes in its cache (its rows must sit in the same
slots as in target-only decoding, for batch invariance), so a length is all the bookkeeping there is.
"""
from __future__ import annotations

import numpy as np

from mirrorsd.manifest import KVSpec


class PresentCache:
    def __init__(self, spec: KVSpec, batch: int = 1) -> None:
        self.spec = spec
        self.layers = list(spec.layer_indices())
        self._past_names = [(spec.past_key % i, spec.past_value % i) for i in self.layers]
        self._present_names = [(spec.present_key % i, spec.present_value % i) for i in self.layers]
        empty = np.zeros((batch, spec.num_kv_heads, 0, spec.head_dim), np.float32)
        self._tensors = [(empty, empty) for _ in self.layers]  # per layer (keys, values) [B, H, >= length, D]
        self.length = 0

    @property
    def batch(self) -> int:
        return self._tensors[0][0].shape[0] if self._tensors else 0

    def past_feeds(self) -> dict[str, np.ndarray]:
        if self._tensors and self._tensors[0][0].shape[2] != self.length:  # after a rollback: compact once
            self._tensors = [(np.ascontiguousarray(k[:, :, : self.length]), np.ascontiguousarray(v[:, :, : self.length]))
                             for k, v in self._tensors]
        feeds = {}
        for (k_name, v_name), (keys, values) in zip(self._past_names, self._tensors):
            feeds[k_name], feeds[v_name] = keys, values
        return feeds

    def append_presents(self, outputs: dict[str, np.ndarray], new: int) -> None:
        """Keep the graph's presents (past + ``new`` slots) as the cache."""
        self._tensors = [(outputs[k_name], outputs[v_name]) for k_name, v_name in self._present_names]
        self.length += new
        if self._tensors and self._tensors[0][0].shape[2] != self.length:
            raise ValueError(f"a graph returned {self._tensors[0][0].shape[2]} KV slots where {self.length} were due")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._tensors)
