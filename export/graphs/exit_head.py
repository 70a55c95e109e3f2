"""Early-exit head: final norm + LM head + top-k on the hidden state at the exit layer, at every position.

    hidden_states [B, S, H] -> norm -> lm_head -> log_softmax -> top-k
        -> topk_ids [B, S, k] int64, topk_logprobs [B, S, k] float32
No trained head: the target's own final norm and LM head are reused (ALGORITHM.md, interpretation 5).
"""
from __future__ import annotations

import torch
from torch import nn

from mirrorsd import names
from mirrorsd.manifest import TensorSpec
from mirrorsd.export.graphs.common import GraphIO, hidden_tensor

ROLE = names.EXIT_HEAD
MODEL = "target"


class ExitHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, top_k: int) -> None:
        super().__init__()
        self.norm, self.lm_head, self.top_k = norm, lm_head, top_k

    def forward(self, hidden_states):
        logits = self.lm_head(self.norm(hidden_states))  # [B, S, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = torch.topk(logprobs, self.top_k, dim=-1)  # [B, S, k]
        return ids, values


def build(source, exit_layer: int, top_k: int):
    arch, model = source.arch, source.model
    module = ExitHead(arch.part(model, arch.final_norm), arch.part(model, arch.lm_head), top_k)
    topk_shape = (names.BATCH, names.SEQUENCE, top_k)
    io = GraphIO((hidden_tensor(source.info.hidden_size),),
                 (TensorSpec(names.TOPK_IDS, "int64", topk_shape), TensorSpec(names.TOPK_LOGPROBS, "float32", topk_shape)),
                 None)
    return module, io, (exit_layer, exit_layer)
