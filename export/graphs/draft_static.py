"""Static-shape draft (role ``draft_static``): the draft model with a fixed KV capacity N and a fixed step width W.

An NPU compiles a graph for fixed shapes only, and the KV input of the ordinary draft grows every step. Here the
host keeps a fixed buffer of N slots per layer and the graph always sees all of them:

    host buffer, N slots          [ k0 k1 k2 .. k(L-1) | empty ............ ]     L = filled slots
    attention_mask [B, N + W]     [ 1  1  1  ..  1     | 0 ................ 0 | 1 .. 1 ]   (holes allowed: 0)
    input_ids, position_ids [B, W]                                              the W new tokens
        -> logits [B, W, vocab]
        -> present.i.key/value [B, kv_heads, W, head_dim]   the W new slots only
    host writes the new slots at [L, L + W) and sets their mask bits on the next step.

Queries sit after all N buffer slots, so every filled slot is causally visible and the mask alone decides what is
attended; empty slots are blocked exactly (their softmax weight is 0), which keeps the result equal to the dynamic
draft's. W is 1 here: prompts are fed one token at a time.

Why a second file rather than ``Model.reshape`` of draft.onnx at load time: reshaping the dynamic draft fixes its
shapes, but its present would still be past + new, so a device would write N + 1 slots back per step to produce one
(N times the traffic), and an ONNX Runtime plugin EP would still see a dynamic file. This file returns the new slots
only and carries N and W in the file. The batch axis stays symbolic: the host uses batch 1 (main cache) and the
Mirror-SD branch batch (rollouts), and a fixed-shape backend compiles one static variant per batch it is fed.
"""
from __future__ import annotations

import numpy as np
from torch import nn

from mirrorsd import names
from mirrorsd.manifest import TensorSpec
from mirrorsd.export.graphs.base import FP32, Traced
from mirrorsd.export.graphs.common import GraphIO, LayerRange, kv_spec, kv_tensors

ROLE = names.DRAFT_STATIC
MODEL = "draft"
CHECKS = {"draft_static_logits": FP32}  # fed one token at a time through its fixed buffer vs the PyTorch draft
QUANTIZED, QUANT_EFFECT = False, None  # NPUs compile it as exported
STEP_WIDTH = 1  # tokens per call: decoding feeds one token per row; a wider step would need its own file
MIN_CONTEXT = 16  # export-time validation feeds a 9-token batch through the buffer
DEFAULT_MAX_CONTEXT = 1024  # KV slots of the buffer; prompt + new tokens + two draft windows must fit


class StaticStep(nn.Module):
    """The draft's LayerRange, returning only the ``width`` new KV slots of each present."""

    def __init__(self, inner: LayerRange, width: int) -> None:
        super().__init__()
        self.inner, self.width = inner, width

    def forward(self, input_ids, attention_mask, position_ids, *past):
        out = self.inner(input_ids, attention_mask, position_ids, *past)
        presents = [p[:, :, -self.width:] for p in out[1:]]  # [B, kv_heads, N + W, D] -> [B, kv_heads, W, D]
        return (out[0], *presents)


def static_shapes(max_context: int, width: int = STEP_WIDTH) -> dict[str, int]:
    """The fixed dimensions, recorded in the manifest's ``static_shapes``."""
    return {names.PAST_SEQUENCE: max_context, names.SEQUENCE: width, names.TOTAL_SEQUENCE: max_context + width,
            names.PRESENT_SEQUENCE: width}


def _fixed(spec: TensorSpec, dims: dict[str, int]) -> TensorSpec:
    return TensorSpec(spec.name, spec.dtype, tuple(dims.get(d, d) if isinstance(d, str) else d for d in spec.shape))


class Graph:
    """The graph module protocol of ``export/graphs`` (graphs/base.py), configured with a KV capacity."""

    ROLE, MODEL, CHECKS, QUANTIZED, QUANT_EFFECT = ROLE, MODEL, CHECKS, QUANTIZED, QUANT_EFFECT

    def __init__(self, max_context: int, width: int = STEP_WIDTH) -> None:
        self.max_context, self.width = max_context, width
        self.static_shapes = static_shapes(max_context, width)

    def build(self, source, exit_layer: int, top_k: int) -> Traced:
        n, arch = source.info.num_layers, source.arch
        kv = kv_spec(0, n, source.info.num_kv_heads, source.info.head_dim)
        past, present = kv_tensors(kv)
        dims = dict(self.static_shapes)
        present_dims = {names.TOTAL_SEQUENCE: self.width}  # present = the new slots only
        inputs = [
            TensorSpec(names.INPUT_IDS, "int64", (names.BATCH, self.width)),
            TensorSpec(names.ATTENTION_MASK, "int64", (names.BATCH, dims[names.TOTAL_SEQUENCE])),
            TensorSpec(names.POSITION_IDS, "int64", (names.BATCH, self.width)),
            *(_fixed(t, dims) for t in past)]
        outputs = [TensorSpec(names.LOGITS, "float32", (names.BATCH, self.width, source.info.vocab_size)),
                   *(_fixed(t, present_dims) for t in present)]
        make = lambda model: StaticStep(LayerRange(model, arch, 0, n, embed=True, head=True), self.width)  # noqa: E731
        return Traced(make, GraphIO(tuple(inputs), tuple(outputs), kv), (0, n), self.static_shapes)

    def validate(self, v) -> list:
        return _validate(v.runner.session, v.source, self.max_context)


def _validate(session, source, max_context: int):
    """Feed a left-padded batch of two through the fixed buffer one token at a time; compare with PyTorch."""
    from mirrorsd.export.validate import Check, compare, sample_batch, torch_reference

    info = source.info
    ids, mask, pos = sample_batch(info.vocab_size, seed=2)
    want, _ = torch_reference(source, ids, mask, pos, info.num_layers, None)
    batch, steps = ids.shape
    shape = (batch, info.num_kv_heads, max_context, info.head_dim)
    buffers = {(layer, t): np.zeros(shape, np.float32) for layer in range(info.num_layers)
               for t in (names.PAST_KEY, names.PAST_VALUE)}
    got = np.zeros_like(want)
    for t in range(steps):
        step_mask = np.zeros((batch, max_context + STEP_WIDTH), np.int64)
        step_mask[:, :t] = mask[:, :t]
        step_mask[:, max_context] = mask[:, t]
        feeds = {names.INPUT_IDS: ids[:, t:t + 1], names.ATTENTION_MASK: step_mask,
                 names.POSITION_IDS: pos[:, t:t + 1]}
        feeds.update({template % layer: buf for (layer, template), buf in buffers.items()})
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        got[:, t] = out[names.LOGITS][:, 0]
        for (layer, template), buf in buffers.items():
            present = (names.PRESENT_KEY if template == names.PAST_KEY else names.PRESENT_VALUE) % layer
            buf[:, :, t] = out[present][:, :, 0]
    check: Check = compare("draft_static_logits", got, want, mask, CHECKS["draft_static_logits"])
    return [check]
