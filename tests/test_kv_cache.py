"""The KV cache against a list model: appending, rolling back and adopting branch rows keep exactly the slots a
Python list would keep (property-based; moved out of test_reliability_runtime.py unchanged)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st


def kv_spec():
    from mirrorsd.manifest import KVSpec

    return KVSpec("past.%d.k", "past.%d.v", "present.%d.k", "present.%d.v", (1, 3), 2, 3, "float32")


def kv_append(cache, rows: list[list[np.ndarray]], new: int, rng) -> None:
    """Feed ``new`` random slots per row as a graph would (present = past + new), to the cache and the model."""
    fresh = rng.normal(size=(cache.batch, new, len(cache.layers), 2, 2, 3)).astype(np.float32)  # [B, S, L, kv, H, D]
    past = cache.past_feeds()
    outputs = {}
    for li, layer in enumerate(cache.layers):
        for kv, (past_name, present_name) in enumerate((("past.%d.k", "present.%d.k"), ("past.%d.v", "present.%d.v"))):
            slots = fresh[:, :, li, kv].transpose(0, 2, 1, 3)  # [B, H, new, D]
            outputs[present_name % layer] = np.concatenate([past[past_name % layer], slots], axis=2)
    cache.append_presents(outputs, new)
    for row, slots in zip(rows, fresh):
        row.extend(slots)


def kv_check(cache, rows: list[list[np.ndarray]]) -> None:
    assert cache.length == len(rows[0]) and all(len(r) == cache.length for r in rows) and cache.batch == len(rows)
    assert cache.capacity >= cache.length
    feeds = cache.past_feeds()
    for li, layer in enumerate(cache.layers):
        for kv, name in enumerate(("past.%d.k", "past.%d.v")):
            want = np.zeros((len(rows), 2, cache.length, 3), np.float32)
            for r, row in enumerate(rows):
                if row:
                    want[r] = np.stack(row)[:, li, kv].transpose(1, 0, 2)  # [H, length, D]
            np.testing.assert_array_equal(feeds[name % layer], want)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**32 - 1), st.lists(st.tuples(
    st.sampled_from(["append", "truncate", "adopt"]), st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)),
    min_size=1, max_size=25))
def test_kv_cache_matches_a_list_model(capacity, seed, ops):
    """Appending, truncating (rollback) and adopting a branch row keep exactly the slots a list would keep."""
    from mirrorsd.runtime.kv_cache import KVCache

    rng = np.random.default_rng(seed)
    cache, rows = KVCache(kv_spec(), 1, capacity), [[]]
    for op, a, b, c in ops:
        if op == "append":
            kv_append(cache, rows, 1 + a, rng)
        elif op == "truncate":
            keep = min(a, cache.length)
            cache.truncate(keep)
            del rows[0][keep:]
        else:  # roll out branch rows from a tiled copy, then adopt a piece of one of them
            branches = 1 + a % 3
            tiled = cache.tiled(branches, b)
            tiled_rows = [list(rows[0]) for _ in range(branches)]
            kv_check(tiled, tiled_rows)
            kv_append(tiled, tiled_rows, 1 + b, rng)
            row, src = c % branches, min(a, tiled.length)
            count, dst = min(b, tiled.length - src), min(c, cache.length)
            cache.adopt_slots(tiled, row, np.arange(src, src + count), dst)
            rows[0][dst:] = tiled_rows[row][src:src + count]
        kv_check(cache, rows)
    with pytest.raises(ValueError):
        cache.truncate(cache.length + 1)
