"""Suffix graph: hidden state at layer L -> logits, running layers [L, N) (KV under their global indices)."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.common import GraphIO, LayerRange, hidden_tensor, kv_spec, kv_tensors, logits_tensor, step_inputs

ROLE = names.SUFFIX
MODEL = "target"


def build(source, exit_layer: int, top_k: int):
    n = source.info.num_layers
    kv = kv_spec(exit_layer, n, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(hidden_tensor(source.info.hidden_size)) + past),
                 (logits_tensor(source.info.vocab_size), *present), kv)
    module = LayerRange(source.model, source.arch, exit_layer, n, embed=False, head=True)
    return module, io, (exit_layer, n)
