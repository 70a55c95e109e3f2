"""The attention every exported graph traces: eager attention, with query heads grouped by their KV head.

    query [B, H, S, D] -> [B, KVH, G*S, D]          (G = H / KVH query heads share one KV head; rows (g, s))
    key   [B, KVH, T, D]                             (T = past + S cache slots; no repeat_kv copy of the cache)
    scores  = query @ key^T      [B, KVH, G*S, T]    one GEMM per KV head
    weights = softmax(scores * scale + mask)          mask [B, 1, S, T] additive, tiled G times along the rows
    output  = weights @ value    [B, KVH, G*S, D] -> [B, S, H, D]

The scores stay 4-d: the mask is tiled to [B, 1, G*S, T] (Tile by a constant) rather than the scores reshaped to
[B, KVH, G, S, T], whose target shape holds two sizes that change per call (S and T) and so would be recomputed
from shapes on every forward (export/shape_constants.py folds the rest of a layer's shape arithmetic).

Why not transformers' eager attention: batch invariance (docs/algorithm.md, Batch invariance). A verification window runs
gamma + 1 query rows where target-only decoding runs one. Eager attention then multiplies [H, 1, D] x [H, D, T]
in one-row decoding, and ONNX Runtime's MLAS takes its one-row (GEMV) kernel for M = 1 and its GEMM kernel for
M > 1, which sum in different orders: a row's logits then depend on the window around it (rounding-level per op,
amplified to whole logit differences by int8 re-quantization of the next MatMulNBits input). Grouped, every GEMM has
M = G*S >= 2 rows, and MLAS's GEMM computes each row the same way whatever M is; a window's extra key slots are
masked (weight exactly 0) and sit after the row's own slots, which adds exact zeros at the end of each sum. Checked
with single-node graphs on ONNX Runtime (several group sizes, one row against five, long contexts;
scripts/lab/window_invariance.py checks a whole target). A model without grouped heads (G = 1) gets one extra all-zero
query row, so that M >= 2 there too. It also reads each KV head once instead of copying it G times (repeat_kv).
"""
from __future__ import annotations

import contextlib

import torch

NAME = "mirrorsd_grouped"
KIND = "grouped"  # what Manifest.attention records for graphs traced with it


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-interface signature; returns (output [B, S, H, D], None)."""
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    rows = query.reshape(batch, kv_heads, groups * seq, dim)  # [B, KVH, G*S, D]; head h = kvh * G + g
    if groups == 1:  # keep M >= 2 so that MLAS never takes its one-row kernel (see the module docstring)
        rows = torch.cat([rows, torch.zeros_like(rows[:, :, :1])], dim=2)  # [B, KVH, S + 1, D]
    scores = torch.matmul(rows, key.transpose(2, 3))[:, :, : groups * seq] * scaling  # [B, KVH, G*S, T]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, S, T]
        if groups > 1:  # row g*S + s gets mask row s
            mask = mask.repeat(1, 1, groups, 1)  # [B, 1, G*S, T]
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # [B, KVH, G*S, T]
    if groups == 1:
        weights = torch.cat([weights, torch.zeros_like(weights[:, :, :1])], dim=2)
    output = torch.matmul(weights, value)[:, :, : groups * seq]  # [B, KVH, G*S, D]
    output = output.reshape(batch, heads, seq, dim).transpose(1, 2).contiguous()  # [B, S, H, D]
    return output, None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_attention)


@contextlib.contextmanager
def traced_with_grouped_attention(module):
    """Trace ``module`` (any wrapper around transformers decoder layers) with ``grouped_attention``: every model
    config its layers read is switched for the duration and restored afterwards, errors included. The PyTorch
    reference that validation compares against keeps transformers' eager attention."""
    register()
    configs = {id(m.config): m.config for m in module.modules() if getattr(m, "config", None) is not None
               and hasattr(m.config, "_attn_implementation")}
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = NAME
        yield module
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]
