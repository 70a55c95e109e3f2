"""Held-out metrics of a streaming draft, teacher-forced on the target's answers (no runtime involved).

    main_top1                  the main row's argmax at t == the target's token t + 1
    stream_top1[j]             stream j's argmax at anchor t == the target's token t + 1 + j
    stream_agrees_with_main[j] stream j at t == the main row's argmax at t + j (what the runtime's main stream
                               checks before it keeps a lookahead token)
    tokens_per_forward         mean over anchors of 1 + the number of leading streams that agree with the main
                               rows: the draft's tokens per forward if its main stream always followed the target
    main_loss, stream_loss     cross-entropies (stream_loss: mean over streams)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ANCHOR_CHUNK = 64  # anchors per forward: bounds the [anchors * n, vocab] logits of a large vocabulary


def sample_inputs(sample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, mask, positions [1, T] of one unpadded sample (prompt + answer)."""
    tokens = torch.tensor([sample.tokens], dtype=torch.long)
    return tokens, torch.ones_like(tokens), torch.arange(tokens.shape[1])[None]


@torch.no_grad()
def evaluate(module, samples, trunk) -> dict:
    """``trunk(sample)`` -> h_f [1, T, H] (the training loop's cache)."""
    n = module.streams
    main_hits = main_count = 0
    main_loss = 0.0
    top1, agree, loss, count = [0] * n, [0] * n, [0.0] * n, [0] * n
    accepted, anchors_seen = 0, 0
    for sample in samples:
        tokens, mask, positions = sample_inputs(sample)
        length, p = tokens.shape[1], len(sample.prompt)
        h_f = trunk(sample)
        candidates = torch.arange(p - 1, length - 1)
        main_pred = None
        for chunk in candidates.split(ANCHOR_CHUNK):
            anchor_ids, stream_ids = chunk.repeat_interleave(n), torch.arange(n).repeat(len(chunk))
            main, streams = module.top(h_f, mask, positions, anchor_ids, stream_ids)
            if main_pred is None:
                main_logits = module.head(main[0, p - 1:length - 1])  # rows t = p-1 .. T-2
                main_loss += float(F.cross_entropy(main_logits, tokens[0, p:], reduction="sum"))
                main_pred = torch.full((length,), -1, dtype=torch.long)
                main_pred[p - 1:length - 1] = main_logits.argmax(-1)
                main_hits += int((main_pred[p - 1:length - 1] == tokens[0, p:]).sum())
                main_count += length - p
            logits = module.head(streams[0]).view(len(chunk), n, -1)  # [K, n, V]
            pred = logits.argmax(-1)  # [K, n]
            for k, t in enumerate(chunk.tolist()):
                leading = True
                for j in range(n):  # stream j + 1 predicts token t + 2 + j
                    label = t + 2 + j
                    if label >= length:
                        break
                    count[j] += 1
                    top1[j] += int(pred[k, j] == tokens[0, label])
                    loss[j] += float(F.cross_entropy(logits[k, j][None], tokens[0, label][None]))
                    same = bool(pred[k, j] == main_pred[label - 1])
                    agree[j] += int(same)
                    if leading and t + 1 + n < length:
                        accepted += int(same)
                    leading = leading and same
                if t + 1 + n < length:
                    anchors_seen += 1
    ratio = lambda a, b: a / b if b else 0.0  # noqa: E731
    return {"samples": len(samples), "answer_tokens": main_count, "main_top1": ratio(main_hits, main_count),
            "main_loss": ratio(main_loss, main_count), "stream_top1": [ratio(a, c) for a, c in zip(top1, count)],
            "stream_agrees_with_main": [ratio(a, c) for a, c in zip(agree, count)],
            "stream_loss": sum(ratio(a, c) for a, c in zip(loss, count)) / n,
            "tokens_per_forward": 1.0 + ratio(accepted, anchors_seen)}
