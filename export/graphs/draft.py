"""Draft graph: the whole draft model (embed, all its layers, norm, LM head) with KV for every layer."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.common import GraphIO, LayerRange, ids_input, kv_spec, kv_tensors, logits_tensor, step_inputs

ROLE = names.DRAFT
MODEL = "draft"


def build(source, exit_layer: int, top_k: int):
    n = source.info.num_layers
    kv = kv_spec(0, n, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(ids_input()) + past), (logits_tensor(source.info.vocab_size), *present), kv)
    module = LayerRange(source.model, source.arch, 0, n, embed=True, head=True)
    return module, io, (0, n)
