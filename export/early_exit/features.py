"""Training data for the exit adapter: the target's own greedy answers to SpecBench prompts, one pass each.

    questions   mirrorsd.specbench: the held-out rule shared with mirrorsd-train-draft and mirrorsd bench
    answers     the export's target, greedy, batched (mirrorsd.export.streaming.data: the same distillation data
                path as the streaming-draft trainer), cached as JSON lines
    one pass    prefix(prompt + answer) -> h(L) -> exit trunk -> x [T, H]  (the LM head's input at the exit)
                        -> suffix -> logits -> the target's greedy token at every position
    rows        positions p-1 .. T-2 (each predicts an answer token): feature x_t, label argmax(logits_t); for
                training also up to --prompt-rows prompt positions before them (held-out rows: answers only)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Rows:
    x: np.ndarray  # [N, H] float32 features
    labels: np.ndarray  # [N] int64 the target's final greedy token
    hidden: np.ndarray  # [M, H] a few raw h(L) rows (graph checks)
    hidden_x: np.ndarray  # [M, H] their features


def distill(target, tokenizer, questions, max_prompt_tokens: int, generation_batch: int, cache: Path,
            progress=lambda n: None, chat: bool = True):
    """The target's greedy answers to ``questions``, in their order. ``cache`` (JSON lines, one answer length per
    file) keeps every answer made so far: a re-run answers only the questions it does not hold."""
    from mirrorsd.export.streaming.data import answer_all, encode, load_samples, save_samples

    held = {s.question_id: s for s in load_samples(cache)} if cache.is_file() else {}
    prompts = encode(tokenizer, questions, max_prompt_tokens, chat)
    missing = [p for p in prompts if p[0] not in held or held[p[0]].prompt != p[1]]
    if missing:
        held.update({s.question_id: s for s in answer_all(target, missing, generation_batch, target.eos_ids,
                                                          progress)})
        save_samples(cache, list(held.values()))
    return [held[qid] for qid, _ in prompts]


def rows(pipe, trunk_session, samples, keep_hidden: int = 16, prompt_rows: int = 0) -> Rows:
    """Features and labels of every answer position of ``samples`` (one target pass per sample), and of the last
    ``prompt_rows`` prompt positions before it (the target's greedy token there: more rows from the same pass)."""
    xs, labels, hidden_rows, hidden_x = [], [], [], []
    feature_input = trunk_session.get_inputs()[0].name
    for sample in samples:
        tokens = sample.prompt + sample.completion
        p = len(sample.prompt)
        if len(tokens) - p < 1:
            continue
        pipe.target.reset(1, len(tokens) + 2)
        hidden, logits = pipe.target.extend_with_hidden(tokens)  # [T, H], [T, V]
        first = max(0, p - 1 - prompt_rows)
        rows_h = hidden[first:len(tokens) - 1]
        x = trunk_session.run(None, {feature_input: rows_h[None]})[0][0]
        xs.append(np.asarray(x, np.float32))
        labels.append(np.argmax(logits[first:len(tokens) - 1], axis=-1).astype(np.int64))
        if sum(len(h) for h in hidden_rows) < keep_hidden:
            hidden_rows.append(rows_h[:keep_hidden])
            hidden_x.append(xs[-1][:keep_hidden])
    if not xs:
        empty = np.zeros((0, 0), np.float32)
        return Rows(empty, np.zeros(0, np.int64), empty, empty)
    return Rows(np.concatenate(xs), np.concatenate(labels), np.concatenate(hidden_rows)[:keep_hidden],
                np.concatenate(hidden_x)[:keep_hidden])
