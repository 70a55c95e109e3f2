"""The KV cache of a graph that writes it in place (devices/kernels/kv_in_place.py): buffers the runtime owns. The
target's graphs and the draft's use it where mirrorsd's kernels run them.

    buffers    one per layer, kind (key / value) and KV head: [B, capacity, D]; slots [0, length) are filled
    step       feed each buffer's slots [0, length + S) as the view [B, 1, length + S, D]; the graph's
               InPlaceAttention nodes fill slots [length, length + S) in place, and attend over the view
    rollback   a length change (the slots after it are overwritten by the next step)
    growth     a step that needs more than the capacity moves the buffers into ones twice as large (rare: decoders
               reserve prompt + answer at reset)
    branches   (the draft's rollouts, runtime/rollout.py) ``tiled`` copies row 0's slots into a cache of several rows;
               ``adopt_slots`` copies one row's slots back into row 0, as KVCache does

With one row (every decoding step; not generate_batch, nor the draft's branch rollouts) ``buffer[:, :T]`` is
contiguous, so a step moves no KV at all: the only copies are the new slots' own. With several rows the slots of one
head are ``capacity`` apart, so each step copies them into a compact view and the new slots back (what feeding a
past from a preallocated buffer cost anyway: ONNX Runtime copies a view that is not contiguous).
"""
from __future__ import annotations

import numpy as np

MIN_CAPACITY = 64


class ViewCache:
    def __init__(self, layers, batch: int = 1, capacity: int = MIN_CAPACITY) -> None:
        self.layers = list(layers)  # InPlaceLayer per rewritten layer (its view input names)
        self._names = [name for layer in self.layers for kind in ("key", "value") for name in layer.views(kind)]
        dims = {name: layer.head_dim for layer in self.layers for kind in ("key", "value") for name in layer.views(kind)}
        capacity = max(capacity, MIN_CAPACITY)
        self._buffers = {name: np.zeros((batch, capacity, dims[name]), np.float32) for name in self._names}
        self._staged: dict[str, np.ndarray] = {}  # the compact views of a step with several rows
        self.length = 0
        self._batch = batch

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def capacity(self) -> int:
        return next(iter(self._buffers.values())).shape[1] if self._buffers else 1 << 30

    def step_feeds(self, new: int) -> dict[str, np.ndarray]:
        """The views for a call that adds ``new`` slots: [B, 1, length + new, D] per buffer."""
        total = self.length + new
        self.reserve(total)
        if self._batch == 1:
            return {name: buf[:, :total][:, None] for name, buf in self._buffers.items()}  # no copy
        self._staged = {name: np.ascontiguousarray(buf[:, :total])[:, None] for name, buf in self._buffers.items()}
        return dict(self._staged)

    def past_feeds(self) -> dict[str, np.ndarray]:
        raise TypeError("a view cache is fed with step_feeds(new): its views span the call's new slots")

    def append_presents(self, outputs: dict, new: int) -> None:
        """Count the ``new`` slots the graph wrote (with several rows, copy them back from the compact views)."""
        start, end = self.length, self.length + new
        for name, view in self._staged.items():
            self._buffers[name][:, start:end] = view[:, 0, start:end]
        self._staged = {}
        self.length = end

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._buffers.values())

    def tiled(self, rows: int, extra: int) -> "ViewCache":
        """A ``rows``-row copy of row 0's filled slots, with room for ``extra`` more (branch rollouts)."""
        out = ViewCache(self.layers, rows, self.length + extra)
        for name, buf in self._buffers.items():
            out._buffers[name][:, : self.length] = buf[0:1, : self.length]  # [rows, length, D] <- [1, length, D]
        out.length = self.length
        return out

    def adopt_slots(self, other: "ViewCache", row: int, slots: np.ndarray, dst_start: int) -> None:
        """Copy ``other``'s ``row`` at the given slot indices (in order; a streamed branch row has holes between
        them) into row 0 here, contiguous from ``dst_start``; slots after them are dropped."""
        count = len(slots)
        self.truncate(dst_start)
        self.reserve(dst_start + count)
        for name, buf in self._buffers.items():
            buf[0, dst_start:dst_start + count] = other._buffers[name][row][slots]  # [count, D]
        self.length = dst_start + count

    def reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        capacity = self.capacity
        while capacity < slots:
            capacity *= 2
        for name, buf in self._buffers.items():
            grown = np.zeros((buf.shape[0], capacity, buf.shape[2]), np.float32)
            grown[:, : self.length] = buf[:, : self.length]
            self._buffers[name] = grown
