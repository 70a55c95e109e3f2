"""Prefix graph: token ids -> hidden state after the early-exit layer L, with KV for layers [0, L)."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.base import FP32, STEM_IDS, Stack
from mirrorsd.export.graphs.common import GraphIO, hidden_tensor, ids_input, kv_spec, kv_tensors, step_inputs

ROLE = names.PREFIX
MODEL = "target"
CHECKS = {"split_hidden": FP32}  # h(L) of the validation batch vs PyTorch's hidden state after layer L
QUANTIZED, QUANT_EFFECT = True, None


def build(source, exit_layer: int, top_k: int) -> Stack:
    kv = kv_spec(0, exit_layer, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(ids_input()) + past), (hidden_tensor(source.info.hidden_size), *present), kv)
    return Stack(io, (0, exit_layer), stem=STEM_IDS, head=None)


def validate(v) -> list:
    from mirrorsd.export.validate import SPLIT_AT, chunked, compare

    ids, mask, pos = v.batch(MODEL)
    out = v.runner.run(chunked(names.INPUT_IDS, (ids, ids[:, :SPLIT_AT], ids[:, SPLIT_AT:]), mask, pos))
    v.shared[ROLE] = out  # the suffix and the exit head run on these hidden states
    _, want_hidden = v.reference(MODEL)
    return [compare("split_hidden", out["full"][names.HIDDEN_STATES], want_hidden, mask, CHECKS["split_hidden"],
                    v.noise(MODEL, 1))]
