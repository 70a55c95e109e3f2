"""The speculative-streaming draft as one PyTorch module; training and the exported graph run the same layers.

    ids [B,S] -embed-> h -layers [0, f)-> h_f --------------------> layers [f, N) -> norm + head -> logits [B,S,V]
                                          |                          (main rows never see stream rows)
                                          +-> h_f[anchor] + E_j ---> same layers, extra rows -> norm + head
                                                                                      -> stream logits [B,Q,V]
    f = N - stream_layers, the first streamed layer. Stream j = 1..n anchored at main position t sits at position
    t + j, attends to the main slots its anchor sees (<= t) and to streams 1..j of the same anchor, and predicts
    token t + 1 + j (the main row at t predicts t + 1). Streams keep no KV: the streamed layers' presents hold the
    past + S main slots only, so the runtime's cache is exactly the plain draft's.

The folder ``mirrorsd-train-draft`` writes is a plain Hugging Face draft (adapters merged) plus ``streaming.json``
(this file's StreamingConfig) and ``streams.safetensors`` (the n stream embeddings).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mirrorsd.errors import ModelSourceError
from mirrorsd.export.graphs.common import ExplicitCache, additive_causal_mask, run_layers

STREAMING_FILE = "streaming.json"
EMBEDDINGS_FILE = "streams.safetensors"
EMBEDDINGS_KEY = "stream_embeddings"
FORMAT = "mirrorsd-streaming-draft"
FORMAT_VERSION = 1
STREAM_LOSS_WEIGHT = 0.1  # the paper's alpha_j for every stream (alpha_0 = 1 for the next-token loss)


@dataclass(frozen=True)
class StreamingConfig:
    """``streaming.json``: what the stream embeddings belong to and how they were trained."""

    streams: int  # n: lookahead tokens per forward beside the main stream's next token
    stream_layers: int  # the top layers that carry streams (they start at layer num_layers - stream_layers)
    num_layers: int
    hidden_size: int
    base_model: str  # the draft the training started from
    target: str  # the model whose greedy text it was distilled on
    method: str  # lora | top | full
    lora_rank: int
    steps: int
    stream_loss_weight: float = STREAM_LOSS_WEIGHT
    evaluation: dict = field(default_factory=dict)  # held-out metrics before / after training
    training: dict = field(default_factory=dict)  # samples, seconds, s/step, peak RSS
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @property
    def first_streamed_layer(self) -> int:
        return self.num_layers - self.stream_layers

    def save(self, folder: Path) -> Path:
        path = Path(folder) / STREAMING_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, folder: Path) -> "StreamingConfig":
        path = Path(folder) / STREAMING_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelSourceError(f"Cannot read {path}", str(exc), "re-run mirrorsd-train-draft") from exc
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise ModelSourceError(f"{path} is not a version-{FORMAT_VERSION} {FORMAT} file",
                                   f"found format {data.get('format')!r} version {data.get('version')!r}"
                                   if isinstance(data, dict) else "it is not a JSON object",
                                   "re-train the draft with this version of mirrorsd-train-draft")
        unknown = set(data) - names
        if unknown:
            raise ModelSourceError(f"Unknown key(s) {sorted(unknown)} in {path}",
                                   "it was written by another version of mirrorsd", "re-train the draft")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ModelSourceError(f"{path} is incomplete", str(exc), "re-train the draft") from exc


def is_streaming_draft(path: str | Path | None) -> bool:
    return path is not None and Path(path).is_dir() and (Path(path) / STREAMING_FILE).is_file()


def load_streams(folder: str | Path, info) -> tuple[StreamingConfig, torch.Tensor]:
    """The config and the [n, H] stream embeddings of a streaming draft folder, checked against its model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = StreamingConfig.load(folder)
    path = folder / EMBEDDINGS_FILE
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing", "a streaming draft keeps its stream embeddings there",
                               "copy the whole folder mirrorsd-train-draft wrote")
    embeddings = load_file(str(path)).get(EMBEDDINGS_KEY)
    expected = (config.streams, info.hidden_size)
    if embeddings is None or tuple(embeddings.shape) != expected or info.num_layers != config.num_layers \
            or not 1 <= config.stream_layers <= info.num_layers:
        raise ModelSourceError(f"The stream embeddings in {folder} do not fit its model",
                               f"expected {EMBEDDINGS_KEY} {expected} over {info.num_layers} layers",
                               "re-train the draft; do not mix files of two trainings")
    return config, embeddings.float()


def stream_mask(attention_mask: torch.Tensor, anchors: torch.Tensor, stream_ids: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, Q, T + Q] of Q stream rows over T main slots (no past) and the Q stream slots.

    anchors [Q]: main index each stream row hangs on; stream_ids [Q]: 0-based j - 1. Row q sees main slot k iff
    k <= anchors[q] and attention_mask[b, k] = 1, and stream slot q' iff same anchor and stream_ids[q'] <= ids[q].
    """
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    main = (slots[None, :] <= anchors[:, None])[None] & (attention_mask[:, None, :] > 0)  # [B, Q, T]
    same = (anchors[:, None] == anchors[None, :]) & (stream_ids[None, :] <= stream_ids[:, None])  # [Q, Q]
    allowed = torch.cat([main, same[None].expand(main.shape[0], -1, -1)], dim=2)[:, None]  # [B, 1, Q, T + Q]
    blocked = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, torch.zeros_like(blocked), blocked)


def _joint_mask(main: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """main [B,1,S,T] + streams [B,1,Q,T+Q] -> [B,1,S+Q,T+Q]: main rows are blocked from every stream slot."""
    q = streams.shape[2]
    blocked = torch.full_like(main[..., :1], torch.finfo(main.dtype).min).expand(-1, -1, -1, q)  # [B,1,S,Q]
    return torch.cat([torch.cat([main, blocked], dim=3), streams], dim=2)


class StreamingDraft(nn.Module):
    """A decoder-only draft with n stream embeddings entering its top ``stream_layers`` layers.

    ``forward`` is the exported graph (streams on the last new token, explicit KV); ``trunk`` and ``top`` are the
    training path (streams on any anchors, no KV). Both go through ``_streamed`` so they cannot drift apart.
    """

    def __init__(self, model: nn.Module, arch, embeddings: torch.Tensor, stream_layers: int) -> None:
        super().__init__()
        self.embed = arch.part(model, arch.embed)
        self.layers = nn.ModuleList(list(arch.part(model, arch.layers)))
        self.rotary = arch.part(model, arch.rotary)
        self.norm = arch.part(model, arch.final_norm)
        self.lm_head = arch.part(model, arch.lm_head)
        if not 1 <= stream_layers <= len(self.layers):
            raise ValueError(f"stream_layers {stream_layers} must be 1..{len(self.layers)}")
        self.first_streamed = len(self.layers) - stream_layers
        self.stream_embeddings = nn.Parameter(embeddings.detach().clone().float())  # [n, H]
        self.register_buffer("offsets", torch.arange(1, self.streams + 1), persistent=False)  # [n]: j

    @property
    def streams(self) -> int:
        return self.stream_embeddings.shape[0]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [..., H] -> [..., vocab]

    def _run(self, layers, hidden, mask, positions, cache):
        return run_layers(layers, hidden, mask, self.rotary(hidden, positions), positions, cache)

    def _streamed(self, hidden, streams, main_mask, streams_mask, positions, stream_positions, cache):
        """Layers [f, N) over S main rows + Q stream rows -> (main [B,S,H], streams [B,Q,H]), both pre-norm."""
        s = hidden.shape[1]
        joint = torch.cat([hidden, streams], dim=1)  # [B, S + Q, H]
        joint = self._run(self.layers[self.first_streamed:], joint, _joint_mask(main_mask, streams_mask),
                          torch.cat([positions, stream_positions], dim=1), cache)
        return joint[:, :s], joint[:, s:]

    # ---- training path (no KV) ------------------------------------------------------------------------------
    def trunk(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """Main stream through layers [0, f): h_f [B, T, H]. Frozen in lora/top training, so it can be cached."""
        hidden = self.embed(input_ids)
        mask = additive_causal_mask(attention_mask, hidden[:, :, 0], hidden.dtype)
        return self._run(self.layers[: self.first_streamed], hidden, mask, position_ids, None)

    def top(self, h_f, attention_mask, position_ids, anchors, stream_ids):
        """Layers [f, N) with streams (anchors [Q], stream_ids [Q] 0-based) -> (main, stream) hidden, pre-norm."""
        main_mask = additive_causal_mask(attention_mask, h_f[:, :, 0], h_f.dtype)
        streams = h_f[:, anchors] + self.stream_embeddings[stream_ids][None]  # [B, Q, H]
        stream_positions = position_ids[:, anchors] + stream_ids[None] + 1  # [B, Q]
        return self._streamed(h_f, streams, main_mask, stream_mask(attention_mask, anchors, stream_ids, h_f.dtype),
                              position_ids, stream_positions, None)

    # ---- the exported graph ---------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask, position_ids, *past):
        """ids [B,S], mask [B,P+S], positions [B,S], past KV -> logits [B,S,V], stream_logits [B,n,V], presents."""
        hidden = self.embed(input_ids)  # [B, S, H]
        cache = ExplicitCache({i: (past[2 * i], past[2 * i + 1]) for i in range(len(self.layers))})
        main_mask = additive_causal_mask(attention_mask, hidden[:, :, 0], hidden.dtype)  # [B, 1, S, P+S]
        hidden = self._run(self.layers[: self.first_streamed], hidden, main_mask, position_ids, cache)
        streams = hidden[:, -1:] + self.stream_embeddings[None]  # [B, n, H]: all hang on the last new token
        stream_positions = position_ids[:, -1:] + self.offsets[None]  # [B, n]
        anchor_row = main_mask[:, :, -1:, :].expand(-1, -1, self.streams, -1)  # [B, 1, n, P+S]
        order = self.offsets[None, :] <= self.offsets[:, None]  # [n, n]: stream j sees streams <= j
        among = torch.where(order, 0.0, torch.finfo(hidden.dtype).min).to(hidden.dtype)
        streams_mask = torch.cat([anchor_row, torch.zeros_like(anchor_row[..., :1]) + among], dim=3)
        hidden, streams = self._streamed(hidden, streams, main_mask, streams_mask, position_ids, stream_positions,
                                         cache)
        presents = []
        for i in range(len(self.layers)):
            key, value = cache.present[i]
            if i >= self.first_streamed:  # drop the stream slots: streams keep no KV
                key, value = key[:, :, : -self.streams], value[:, :, : -self.streams]
            presents += [key, value]
        return (self.head(hidden), self.head(streams), *presents)
