"""The layer-range module that every exported graph is cut from, and the typed I/O spec of a graph.

    input_ids --[embed]--> h --[layers a..b)--> h --[final norm + LM head]--> logits
        prefix  = embed + layers [0, L)            -> hidden_states
        suffix  =         layers [L, N) + head     -> logits
        draft   = embed + layers [0, K) + head     -> logits   (on the draft model)
        exit head (separate module): final norm + LM head + top-k on h(L)

KV for layer i enters as ``past_key_values.i.key/value`` [batch, kv_heads, past, head_dim] and leaves as
``present.i.key/value`` [batch, kv_heads, past + seq, head_dim], with *global* layer indices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mirrorsd import names
from mirrorsd.manifest import KVSpec, TensorSpec
from mirrorsd.export.architectures import Architecture


class ExplicitCache:
    """Stands in for a transformers Cache during tracing: prepends the explicit past, records the present."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, cache_kwargs=None):
        past_key, past_value = self.past[layer_idx]
        key = torch.cat([past_key, key], dim=2)  # [B, kv_heads, past + seq, head_dim]
        value = torch.cat([past_value, value], dim=2)
        self.present[layer_idx] = (key, value)
        return key, value


def additive_causal_mask(attention_mask: torch.Tensor, seq_len_like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, past + seq] 0/1 mask -> [B, 1, seq, past + seq] additive mask (0 = attend, dtype min = blocked).

    Query i sits at slot past + i; it sees key slot j iff j <= past + i and attention_mask[b, j] == 1. Holes in the
    mask (padding, abandoned branch slots) are simply blocked, so callers may leave gaps in the cache.
    """
    key_slots = torch.cumsum(torch.ones_like(attention_mask[0]), dim=0) - 1  # [T]
    query_steps = torch.cumsum(torch.ones_like(seq_len_like[0]), dim=0) - 1  # [S]
    past = attention_mask.shape[1] - seq_len_like.shape[1]
    query_slots = query_steps + past  # [S]
    causal = key_slots[None, :] <= query_slots[:, None]  # [S, T]
    allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # [B, 1, S, T]
    blocked = torch.full_like(allowed, torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, torch.zeros_like(blocked), blocked)


class Stem(nn.Module):
    """What every layer of a graph shares: the embedded ids (or the incoming hidden state), the mask, RoPE."""

    def __init__(self, embed: nn.Module | None, rotary: nn.Module) -> None:
        super().__init__()
        self.embed, self.rotary = embed, rotary

    def forward(self, tokens_or_hidden, attention_mask, position_ids):
        # tokens_or_hidden: [B, S] int64 ids (with embed) or [B, S, H] float hidden states
        hidden = self.embed(tokens_or_hidden) if self.embed is not None else tokens_or_hidden  # [B, S, H]
        mask = additive_causal_mask(attention_mask, hidden[:, :, 0], hidden.dtype)  # [B, 1, S, P+S]
        cos, sin = self.rotary(hidden, position_ids)  # [B, S, head_dim] each
        return hidden, mask, cos, sin


def run_layers(layers, hidden, mask, rope, position_ids, cache):
    """Decoder layers as every exported graph calls them (one place to change how a layer is invoked)."""
    for layer in layers:
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                    use_cache=cache is not None, position_embeddings=rope)
        hidden = out[0] if isinstance(out, tuple) else out  # [B, S, H]
    return hidden


class Head(nn.Module):
    """Final norm + LM head: [B, S, H] -> [B, S, vocab]."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden):
        return self.lm_head(self.norm(hidden))


class LayerRange(nn.Module):
    """Runs layers [first, end) of a decoder, optionally embedding ids first and applying norm + LM head after."""

    def __init__(self, model: nn.Module, arch: Architecture, first: int, end: int, embed: bool, head: bool) -> None:
        super().__init__()
        self.first, self.end = first, end
        self.stem = Stem(arch.part(model, arch.embed) if embed else None, arch.part(model, arch.rotary))
        self.layers = nn.ModuleList(list(arch.part(model, arch.layers))[first:end])
        self.head = Head(arch.part(model, arch.final_norm), arch.part(model, arch.lm_head)) if head else None

    def forward(self, tokens_or_hidden, attention_mask, position_ids, *past):
        hidden, mask, cos, sin = self.stem(tokens_or_hidden, attention_mask, position_ids)
        cache = ExplicitCache({
            self.first + i: (past[2 * i], past[2 * i + 1]) for i in range(self.end - self.first)})
        hidden = run_layers(self.layers, hidden, mask, (cos, sin), position_ids, cache)
        if self.head is not None:
            hidden = self.head(hidden)  # [B, S, vocab]
        presents = []
        for i in range(self.first, self.end):
            presents.extend(cache.present[i])
        return (hidden, *presents)


@dataclass(frozen=True)
class GraphIO:
    """What one graph takes and returns, in the order the wrapper's forward uses."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kv: KVSpec | None

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        axes = {}
        for spec in (*self.inputs, *self.outputs):
            dyn = {i: d for i, d in enumerate(spec.shape) if isinstance(d, str)}
            if dyn:
                axes[spec.name] = dyn
        return axes


def kv_spec(first: int, end: int, num_kv_heads: int, head_dim: int) -> KVSpec:
    return KVSpec(names.PAST_KEY, names.PAST_VALUE, names.PRESENT_KEY, names.PRESENT_VALUE, (first, end),
                  num_kv_heads, head_dim, "float32")


def kv_tensors(kv: KVSpec) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Past inputs and present outputs of a KV spec, interleaved key/value per layer."""
    past_shape = (names.BATCH, kv.num_kv_heads, names.PAST_SEQUENCE, kv.head_dim)
    present_shape = (names.BATCH, kv.num_kv_heads, names.TOTAL_SEQUENCE, kv.head_dim)
    past, present = [], []
    for i in kv.layer_indices():
        past += [TensorSpec(kv.past_key % i, kv.dtype, past_shape), TensorSpec(kv.past_value % i, kv.dtype, past_shape)]
        present += [TensorSpec(kv.present_key % i, kv.dtype, present_shape),
                    TensorSpec(kv.present_value % i, kv.dtype, present_shape)]
    return past, present


def step_inputs(first_input: TensorSpec) -> list[TensorSpec]:
    return [
        first_input,
        TensorSpec(names.ATTENTION_MASK, "int64", (names.BATCH, names.TOTAL_SEQUENCE)),
        TensorSpec(names.POSITION_IDS, "int64", (names.BATCH, names.SEQUENCE)),
    ]


def ids_input() -> TensorSpec:
    return TensorSpec(names.INPUT_IDS, "int64", (names.BATCH, names.SEQUENCE))


def hidden_tensor(hidden_size: int) -> TensorSpec:
    return TensorSpec(names.HIDDEN_STATES, "float32", (names.BATCH, names.SEQUENCE, hidden_size))


def logits_tensor(vocab_size: int) -> TensorSpec:
    return TensorSpec(names.LOGITS, "float32", (names.BATCH, names.SEQUENCE, vocab_size))
