"""Draft graph: the whole draft model (embed, all its layers, norm, LM head) with KV for every layer."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.base import FP32, HEAD_LOGITS, STEM_IDS, Stack
from mirrorsd.export.graphs.common import GraphIO, ids_input, kv_spec, kv_tensors, logits_tensor, step_inputs

ROLE = names.DRAFT
MODEL = "draft"
CHECKS = {"draft_logits": FP32,  # whole batch vs the PyTorch draft
          "draft_cached_logits": FP32}  # in two chunks, the first chunk's KV feeding the second
QUANTIZED, QUANT_EFFECT = True, "draft"


def build(source, exit_layer: int, top_k: int) -> Stack:
    n = source.info.num_layers
    kv = kv_spec(0, n, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(ids_input()) + past), (logits_tensor(source.info.vocab_size), *present), kv)
    return Stack(io, (0, n), stem=STEM_IDS, head=HEAD_LOGITS)


def validate(v) -> list:
    from mirrorsd.export.validate import SPLIT_AT, chunked, compare

    ids, mask, pos = v.batch(MODEL)
    out = v.runner.run(chunked(names.INPUT_IDS, (ids, ids[:, :SPLIT_AT], ids[:, SPLIT_AT:]), mask, pos))
    v.shared[ROLE] = out
    want, _ = v.reference(MODEL)
    return [compare("draft_logits", out["full"][names.LOGITS], want, mask, CHECKS["draft_logits"],
                    v.noise(MODEL, 0)),
            compare("draft_cached_logits", out["b"][names.LOGITS], want[:, SPLIT_AT:], mask[:, SPLIT_AT:],
                    CHECKS["draft_cached_logits"], v.noise(MODEL, 0, slice(SPLIT_AT, None)))]
