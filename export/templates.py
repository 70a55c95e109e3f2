"""Trace each kind of graph piece once, on a one-layer stand-in of the model, and record where each weight went.

    stem.ids      input_ids, attention_mask, position_ids      -> hidden, mask, cos, sin   (embedding, mask, RoPE)
    stem.hidden   hidden_states, attention_mask, position_ids  -> mask, cos, sin
    layer         hidden, mask, cos, sin, past_key, past_value -> hidden, present_key, present_value
    head.logits   hidden -> logits                                      (final norm + LM head)
    head.topk     hidden -> topk_ids, topk_logprobs                     (the exit head)

The stand-in has the model's own module classes and config, one decoder layer and a small vocabulary; its
parameters hold distinct random values, so every initializer of the traced piece is found again by value: a
parameter as is, or transposed (TorchScript folds Linear's transpose into the MatMul constant). The piece keeps
its graph without those values; assembly.py puts each layer's real tensors in their place. The pieces call the
same modules as the whole-graph trace (graphs/common.py: Stem, run_layers, Head), so a change there reaches both.
"""
from __future__ import annotations

import copy
import io
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mirrorsd.errors import UnsupportedArchitectureError
from mirrorsd.export.architectures import Architecture
from mirrorsd.export.graphs.base import HEAD_LOGITS, HEAD_TOPK, LAYER, STEM_HIDDEN, STEM_IDS
from mirrorsd.export.graphs.common import ExplicitCache, Head, Stem, run_layers
from mirrorsd.export.graphs.exit_head import ExitHead
from mirrorsd.export.graphs import attention

SAMPLE = {"batch": 2, "seq": 3, "past": 2}  # trace dims, all different so that no axis is specialised by accident
MIN_VOCAB = 64  # the stand-in's vocabulary (at least top_k + 1): the real one only changes initializer shapes


@dataclass(frozen=True)
class WeightUse:
    """One initializer of a traced piece that is a model parameter: ``part.name`` (module-relative), maybe transposed."""

    initializer: str
    part: str  # the piece's submodule: embed, layer, norm, lm_head
    name: str  # parameter name inside that submodule
    transposed: bool


@dataclass(frozen=True)
class Piece:
    """A traced piece: its graph (constants kept, weights left out) and where each weight goes."""

    kind: str
    graph: Any  # onnx.GraphProto
    opset_import: tuple
    ir_version: int
    weights: tuple[WeightUse, ...]
    dtype: torch.dtype  # of its weights and activations (float32, or float16 for fp16 graphs)

    @property
    def inputs(self) -> list[str]:
        return [i.name for i in self.graph.input]

    @property
    def outputs(self) -> list[str]:
        return [o.name for o in self.graph.output]


class _StemPiece(nn.Module):
    def __init__(self, stem: Stem, with_hidden: bool) -> None:
        super().__init__()
        self.stem, self.with_hidden = stem, with_hidden

    def forward(self, first, attention_mask, position_ids):
        hidden, mask, cos, sin = self.stem(first, attention_mask, position_ids)
        return (hidden, mask, cos, sin) if self.with_hidden else (mask, cos, sin)


class _LayerPiece(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden, mask, cos, sin, past_key, past_value):
        cache = ExplicitCache({0: (past_key, past_value)})  # the stand-in's only layer has index 0
        hidden = run_layers([self.layer], hidden, mask, (cos, sin), None, cache)
        return (hidden, *cache.present[0])


def trace_pieces(config: Any, arch: Architecture, kinds: set[str], top_k: int, dtype: torch.dtype = torch.float32,
                 layer_index: int = 0) -> dict:
    """{kind: Piece} for the requested kinds, from a one-layer stand-in shaped like layer ``layer_index``.

    In float16 the stand-in runs as transformers runs a half-precision model (norms, softmax and RoPE still
    computed in float32 where its code says so); the graph's float32 inputs and outputs get casts in assembly."""
    standin = _standin(config, arch, layer_index, max(MIN_VOCAB, top_k + 1), dtype)
    part = lambda dotted: arch.part(standin, dotted)  # noqa: E731
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    b, s, p = SAMPLE["batch"], SAMPLE["seq"], SAMPLE["past"]
    hidden = torch.randn(b, s, config.hidden_size, dtype=dtype)
    floats = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    ids, mask2d, pos = torch.arange(b * s).reshape(b, s) % 7, torch.ones(b, p + s, dtype=torch.int64), \
        torch.arange(s).repeat(b, 1)
    bs, bst, bsd = {0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, {0: "batch", 1: "seq"}
    specs = {
        STEM_IDS: (lambda: _StemPiece(Stem(part(arch.embed), part(arch.rotary)), True), (ids, mask2d, pos),
                   ["first", "attention_mask", "position_ids"], ["hidden", "mask", "cos", "sin"],
                   {"first": bs, "attention_mask": bst, "position_ids": bs, "hidden": bs,
                    "mask": {0: "batch", 2: "seq", 3: "total"}, "cos": bsd, "sin": bsd}),
        STEM_HIDDEN: (lambda: _StemPiece(Stem(None, part(arch.rotary)), False), (hidden, mask2d, pos),
                      ["first", "attention_mask", "position_ids"], ["mask", "cos", "sin"],
                      {"first": bs, "attention_mask": bst, "position_ids": bs,
                       "mask": {0: "batch", 2: "seq", 3: "total"}, "cos": bsd, "sin": bsd}),
        LAYER: (lambda: _LayerPiece(list(part(arch.layers))[0]),
                (hidden, torch.zeros(b, 1, s, p + s, dtype=dtype), floats(b, s, head_dim), floats(b, s, head_dim),
                 floats(b, kv, p, head_dim), floats(b, kv, p, head_dim)),
                ["hidden", "mask", "cos", "sin", "past_key", "past_value"], ["hidden_out", "present_key",
                                                                             "present_value"],
                {"hidden": bs, "mask": {0: "batch", 2: "seq", 3: "total"}, "cos": bsd, "sin": bsd,
                 "past_key": {0: "batch", 2: "past"}, "past_value": {0: "batch", 2: "past"}, "hidden_out": bs,
                 "present_key": {0: "batch", 2: "total"}, "present_value": {0: "batch", 2: "total"}}),
        HEAD_LOGITS: (lambda: Head(part(arch.final_norm), part(arch.lm_head)), (hidden,), ["hidden"], ["logits"],
                      {"hidden": bs, "logits": bs}),
        HEAD_TOPK: (lambda: ExitHead(part(arch.final_norm), part(arch.lm_head), top_k), (hidden,), ["hidden"],
                    ["topk_ids", "topk_logprobs"], {"hidden": bs, "topk_ids": bs, "topk_logprobs": bs}),
    }
    return {kind: _trace(kind, dtype, *specs[kind]) for kind in sorted(kinds)}


def _standin(config: Any, arch: Architecture, layer_index: int, vocab: int, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    small.num_hidden_layers, small.vocab_size = 1, vocab
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):  # real ids may not fit the small vocabulary
        setattr(small, attr, None)
    if getattr(small, "layer_types", None):
        small.layer_types = [config.layer_types[layer_index]]
    model = AutoModelForCausalLM.from_config(small, dtype=dtype, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for k, (_, param) in enumerate(model.named_parameters()):  # [2k, 2k + 1): no two weights share a value
            param.copy_(torch.rand(param.shape, generator=generator) + 2 * k)
    return model


def _trace(kind: str, dtype: torch.dtype, make, args, input_names, output_names, axes) -> Piece:
    import onnx

    from mirrorsd.export.onnx_writer import OPSET

    module = make()
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings(), attention.traced_with_grouped_attention(module):
        warnings.simplefilter("ignore")  # tracer warnings about Python values are expected for config ints
        torch.onnx.export(module, args, buffer, input_names=input_names, output_names=output_names,
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
    model = onnx.load_from_string(buffer.getvalue())
    graph = model.graph
    uses = _find_weights(kind, graph, module)
    _fold_shapes(kind, model)
    weights = {u.initializer for u in uses}
    kept = [t for t in graph.initializer if t.name not in weights]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    graph.ClearField("value_info")  # shapes of the stand-in (small vocabulary); ONNX Runtime infers its own
    return Piece(kind, graph, tuple(model.opset_import), model.ir_version, tuple(uses), dtype)


def _fold_shapes(kind: str, model) -> None:
    """Shape arithmetic -> constants where they hold at every size (shape_constants.py); the piece keeps its weights
    for the probes, and stays as traced where the folded piece is not bitwise equal."""
    from mirrorsd.export import shape_constants

    def feeds(dims: tuple) -> dict:
        batch, seq, past = dims

        def integers(name: str, shape: tuple) -> np.ndarray:
            if name == "attention_mask":
                return np.ones(shape, np.int64)
            if name == "position_ids":  # [batch, seq]: the positions after the cache
                return np.broadcast_to(past + np.arange(seq), shape).copy()
            return np.arange(int(np.prod(shape))).reshape(shape) % MIN_VOCAB  # token ids

        sizes = {"batch": batch, "seq": seq, "past": past, "total": past + seq}
        return shape_constants.random_feeds(model.graph, sizes, integers)

    report = shape_constants.fold(model, feeds, shape_constants.onnxruntime_runner)
    if report.kept_because:
        warnings.warn(f"{kind} piece: its shape arithmetic is kept as traced ({report.kept_because}); the graph is "
                      f"correct, its forwards only a little slower", stacklevel=2)


def _find_weights(kind: str, graph, module: nn.Module) -> list[WeightUse]:
    from onnx import numpy_helper

    params = {name: p.detach().numpy() for name, p in module.named_parameters()}
    uses = []
    for init in graph.initializer:
        value = numpy_helper.to_array(init)
        use = _match(init.name, value, params)
        if use is not None:
            uses.append(use)
        elif value.ndim and any(value.shape in (p.shape, p.T.shape) for p in params.values()):
            # a float constant shaped like a weight is a weight folded with something: its values would be lost
            raise _unmapped(kind, f"initializer '{init.name}' {value.shape} is no parameter as is or transposed")
    missing = set(params) - {f"{u.part}.{u.name}" for u in uses} - {f"stem.{u.part}.{u.name}" for u in uses}
    if missing:
        raise _unmapped(kind, f"parameters {sorted(missing)[:3]} do not appear as initializers")
    return uses


def _match(initializer: str, value: np.ndarray, params: dict) -> WeightUse | None:
    """The parameter ``value`` holds (its values are distinct from every other parameter's), as is or transposed."""
    for name, param in params.items():
        for transposed, candidate in ((False, param), (True, param.T)):
            if candidate.shape == value.shape and np.array_equal(candidate, value):
                name = name.removeprefix("stem.")  # the stem piece wraps graphs/common.Stem
                part, _, rest = name.partition(".")
                return WeightUse(initializer, part, rest, transposed)
    return None


def _unmapped(kind: str, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"The {kind} piece of this architecture cannot be exported layer by layer", why,
        "export with --whole-graphs (traces each graph whole; needs about 3x the model's fp32 size in memory)")
