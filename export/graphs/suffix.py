"""Suffix graph: hidden state at layer L -> logits, running layers [L, N) (KV under their global indices)."""
from __future__ import annotations

from mirrorsd import names
from mirrorsd.export.graphs.base import FP32, HEAD_LOGITS, STEM_HIDDEN, Stack
from mirrorsd.export.graphs.common import GraphIO, hidden_tensor, kv_spec, kv_tensors, logits_tensor, step_inputs

ROLE = names.SUFFIX
MODEL = "target"
CHECKS = {"split_logits": FP32,  # prefix -> suffix over the whole batch vs the PyTorch model's logits
          "cached_logits": FP32}  # the same, in two chunks with the first chunk's KV feeding the second
QUANTIZED, QUANT_EFFECT = True, "target"  # the target's logits come out here


def build(source, exit_layer: int, top_k: int) -> Stack:
    n = source.info.num_layers
    kv = kv_spec(exit_layer, n, source.info.num_kv_heads, source.info.head_dim)
    past, present = kv_tensors(kv)
    io = GraphIO(tuple(step_inputs(hidden_tensor(source.info.hidden_size)) + past),
                 (logits_tensor(source.info.vocab_size), *present), kv)
    return Stack(io, (exit_layer, n), stem=STEM_HIDDEN, head=HEAD_LOGITS)


def validate(v) -> list:
    from mirrorsd.export.validate import SPLIT_AT, chunked, compare

    _, mask, pos = v.batch(MODEL)
    hidden = {run: out[names.HIDDEN_STATES] for run, out in v.shared[names.PREFIX].items()}
    out = v.runner.run(chunked(names.HIDDEN_STATES, (hidden["full"], hidden["a"], hidden["b"]), mask, pos))
    v.shared[ROLE] = out
    want, _ = v.reference(MODEL)
    return [compare("split_logits", out["full"][names.LOGITS], want, mask, CHECKS["split_logits"],
                    v.noise(MODEL, 0)),
            compare("cached_logits", out["b"][names.LOGITS], want[:, SPLIT_AT:], mask[:, SPLIT_AT:],
                    CHECKS["cached_logits"], v.noise(MODEL, 0, slice(SPLIT_AT, None)))]
