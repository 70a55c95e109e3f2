"""Early-exit head: final norm + LM head + top-k on the hidden state at the exit layer, at every position.

    hidden_states [B, S, H] -> norm -> lm_head -> log_softmax -> top-k
        -> topk_ids [B, S, k] int64, topk_logprobs [B, S, k] float32
No trained head: the target's own final norm and LM head are reused (docs/algorithm.md, Interpretations, 5).
"""
from __future__ import annotations

import torch
from torch import nn

from mirrorsd import names
from mirrorsd.manifest import TensorSpec
from mirrorsd.export.graphs.base import FP32, HEAD_TOPK, Stack
from mirrorsd.export.graphs.common import GraphIO, hidden_tensor

ROLE = names.EXIT_HEAD
MODEL = "target"
CHECKS = {"exit_topk_logprobs": FP32}  # the graph vs PyTorch norm + LM head + top-k, both on PyTorch's h(L)
QUANTIZED, QUANT_EFFECT = True, None


class ExitHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, top_k: int) -> None:
        super().__init__()
        self.norm, self.lm_head, self.top_k = norm, lm_head, top_k

    def forward(self, hidden_states):
        logits = self.lm_head(self.norm(hidden_states))  # [B, S, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = torch.topk(logprobs, self.top_k, dim=-1)  # [B, S, k]
        return ids, values


def build(source, exit_layer: int, top_k: int) -> Stack:
    topk_shape = (names.BATCH, names.SEQUENCE, top_k)
    io = GraphIO((hidden_tensor(source.info.hidden_size),),
                 (TensorSpec(names.TOPK_IDS, "int64", topk_shape), TensorSpec(names.TOPK_LOGPROBS, "float32", topk_shape)),
                 None)
    return Stack(io, (exit_layer, exit_layer), stem=None, head=HEAD_TOPK, top_k=top_k)


def validate(v) -> list:
    from mirrorsd.export.validate import Run, compare

    _, mask, _ = v.batch(MODEL)
    _, want_hidden = v.reference(MODEL)  # the head's own check: both sides read PyTorch's h(L) (split_hidden checks
    # the prefix's h(L); fed the prefix's, a massive-activation model's rounding there moved the log-probs past FP32)
    got = v.runner.run([Run("full", {names.HIDDEN_STATES: want_hidden})])["full"][names.TOPK_LOGPROBS]
    model, arch, top_k = v.source.model, v.source.arch, got.shape[-1]
    with torch.no_grad():
        ref = torch.log_softmax(arch.part(model, arch.lm_head)(arch.part(model, arch.final_norm)(
            torch.from_numpy(want_hidden))), dim=-1)
        want = torch.topk(ref, top_k, dim=-1).values.numpy()
    return [compare("exit_topk_logprobs", got, want, mask, CHECKS["exit_topk_logprobs"])]
