"""Prefix graph: token ids -> hidden state after the early-exit layer L, with KV for layers [0, L)."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.common import GraphIO, LayerRange, hidden_tensor, ids_input, kv_spec, kv_tensors, step_inputs

ROLE = names.PREFIX
MODEL = "target"


def build(source, exit_layer: int, top_k: int):
    kv = kv_spec(0, exit_layer, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(ids_input()) + past), (hidden_tensor(source.info.hidden_size), *present), kv)
    module = LayerRange(source.model, source.arch, 0, exit_layer, embed=True, head=False)
    return module, io, (0, exit_layer)
