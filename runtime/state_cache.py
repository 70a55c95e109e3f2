"""The KV cache of a stateful session (OpenVINO with ``OpenVINOTuning.stateful``): the KV stays inside the backend's
request, and the runtime holds only a length.

    step:      feed nothing for the past; the graph appends S slots to its own state        length += S
    rollback:  length L' < L; before the next call the session trims its state to L'     (OpenVINOSession.trim_state)
    reset:     the state is emptied; the next call's batch becomes the state's batch

Same interface as KVCache (``past_feeds``, ``append_presents``, ``truncate``, ``length``, ``batch``), so the target
drives it the same way. The trim is deferred to the next call: a truncate followed by a truncate costs one trim.
"""
from __future__ import annotations


class StateCache:
    def __init__(self, backend, batch: int = 1) -> None:
        self.backend = backend
        self.batch = batch
        self.length = 0
        backend.reset_state()

    def past_feeds(self) -> dict:
        if self.backend.state_length != self.length:
            self.backend.trim_state(self.length)
        return {}

    def append_presents(self, outputs: dict, new: int) -> None:
        self.length += new
        if self.backend.state_length != self.length:
            raise ValueError(f"the stateful graph holds {self.backend.state_length} KV slots where {self.length} "
                             "were due")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length


def target_cache(session, batch: int = 1, capacity: int = 64, kind: str = "present"):
    """The cache for one of the target's graphs: its backend's state when the session is stateful, buffers the
    graph writes in place when its session was rewritten so (runtime/view_cache.py), else the graph's presents
    (``kind`` "present", runtime/present_cache.py) or a preallocated buffer ("buffer", KVCache)."""
    from mirrorsd.runtime.kv_cache import KVCache
    from mirrorsd.runtime.present_cache import PresentCache
    from mirrorsd.runtime.view_cache import ViewCache

    if getattr(session.backend, "stateful", False):
        return StateCache(session.backend, batch)
    if getattr(session.backend, "kv_in_place", None):
        return ViewCache(session.backend.kv_in_place, batch, capacity)
    return PresentCache(session.spec.kv, batch) if kind == "present" else KVCache(session.spec.kv, batch, capacity)
