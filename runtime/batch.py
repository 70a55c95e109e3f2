"""Target-only greedy decoding of several prompts at once, left-padded (what transformers' batched generate does).

    ids   [B, T]  prompts right-aligned, pad slots masked out (mask 0)
    pos   [B, T]  logical positions: cumsum(mask) - 1 (padding excluded)
The prompts are read PREFILL_CHUNK columns at a time (runtime/models.py), as a single prompt is: a chunk's queries
attend to the mask's columns up to its end. Each step then feeds one token per row; rows that reached EOS keep
stepping (their extra tokens are dropped).
"""
from __future__ import annotations

import numpy as np

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime import models
from mirrorsd.runtime.models import TargetModel
from mirrorsd.runtime.verify import greedy_tokens


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def check_batch(prompts: list[list[int]], max_new_tokens: int, context_limit: int | None = None) -> None:
    """Non-empty prompts and max_new_tokens >= 1; with ``context_limit``, the longest prompt plus max_new_tokens
    within it."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise GenerationInputError(f"max_new_tokens must be an int, not {type(max_new_tokens).__name__}",
                                   "it counts the tokens to generate", "pass an int >= 1, or None")
    if not prompts or any(not p for p in prompts) or max_new_tokens < 1:
        raise GenerationInputError("generate_batch needs non-empty prompts and max_new_tokens >= 1",
                                   "there is nothing to generate", "check the arguments")
    if context_limit is not None and max(len(p) for p in prompts) + max_new_tokens > context_limit:
        raise GenerationInputError("A prompt plus max_new_tokens exceeds the context",
                                   f"the exported graphs allow {context_limit} tokens", "shorten it")


def prefill_batch(target: TargetModel, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                  chunk: int | None = None) -> np.ndarray:
    """Feed the left-padded prompts ids [B, T] (mask [B, T], positions [B, T]) to the empty caches, ``chunk``
    columns at a time (PREFILL_CHUNK); returns the last column's logits [B, vocab]."""
    chunk = chunk or models.PREFILL_CHUNK
    logits = None
    for start in range(0, ids.shape[1], chunk):
        end = min(start + chunk, ids.shape[1])
        logits = target.forward(ids[:, start:end], mask[:, :end], positions[:, start:end])  # [B, end - start, vocab]
    if logits is None:
        raise ValueError("prefill_batch needs at least one column")
    return logits[:, -1]


def generate_batch(target: TargetModel, prompts: list[list[int]], max_new_tokens: int,
                   eos_token_ids: tuple[int, ...], pad_id: int) -> list[list[int]]:
    ids, mask = left_pad(prompts, pad_id)
    batch = len(prompts)
    target.reset(batch, ids.shape[1] + max_new_tokens + 1)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    logits = prefill_batch(target, ids, mask, positions)  # [B, vocab]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = np.zeros(batch, bool)
    next_pos = positions[:, -1:] + 1  # [B, 1]
    for step in range(max_new_tokens):
        tokens = greedy_tokens(logits)  # [B]
        for row in np.flatnonzero(~finished):
            outputs[row].append(int(tokens[row]))
            finished[row] = tokens[row] in eos_token_ids
        if finished.all() or step + 1 == max_new_tokens:
            break
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        logits = target.forward(tokens[:, None].astype(np.int64), mask, next_pos)[:, -1]
        next_pos = next_pos + 1
    return outputs
