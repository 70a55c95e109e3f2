"""Streaming draft graph (role ``draft_streaming``): the draft plus n stream slots hung on its last new token.

    input_ids [B,S], attention_mask [B,P+S], position_ids [B,S], past_key_values.i.key/value [B,h,P,D]  (= draft)
      -> logits          [B,S,V]    main stream: row s predicts the token after input s (checks the lookahead)
      -> stream_logits   [B,n,V]    stream j = 1..n predicts the token j + 1 after the last input (next lookahead)
      -> present.i.key/value [B,h,P+S,D]   main slots only: streams keep no KV
The inputs and the KV are draft.onnx's, so one cache serves both graphs; n is fixed in the file (static-shape
friendly). Written when ``mirrorsd-export --draft`` points at a folder from ``mirrorsd-train-draft``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mirrorsd import names
from mirrorsd.manifest import TensorSpec
from mirrorsd.export.graphs.common import GraphIO, ids_input, kv_spec, kv_tensors, logits_tensor, step_inputs
from mirrorsd.export.streaming.model import StreamingConfig, StreamingDraft, is_streaming_draft, load_streams

ROLE = names.DRAFT_STREAMING
MODEL = "draft"
CHECKS = ("draft_streaming_logits", "draft_streaming_cached_logits", "draft_streaming_stream_logits")


class Graph:
    """The graph module interface of ``export/graphs`` (ROLE, MODEL, build), holding the trained streams."""

    ROLE, MODEL = ROLE, MODEL
    static_shapes: dict = {}

    def __init__(self, config: StreamingConfig, embeddings: torch.Tensor) -> None:
        self.config, self.embeddings = config, embeddings

    def module(self, source) -> StreamingDraft:
        return StreamingDraft(source.model, source.arch, self.embeddings, self.config.stream_layers).eval()

    def build(self, source, exit_layer: int, top_k: int):
        info = source.info
        kv = kv_spec(0, info.num_layers, info.num_kv_heads, info.head_dim)
        past, present = kv_tensors(kv)
        streams = TensorSpec(names.STREAM_LOGITS, "float32", (names.BATCH, self.config.streams, info.vocab_size))
        io = GraphIO(tuple(step_inputs(ids_input()) + past), (logits_tensor(info.vocab_size), streams, *present), kv)
        return self.module(source), io, (0, info.num_layers)

    def validate(self, folder: Path, source) -> list:
        """Main logits vs the plain PyTorch draft; stream logits, whole and after a cached chunk, vs the module's
        training path (streams on explicit anchors, no KV): the two code paths must agree."""
        from mirrorsd.export.validate import SPLIT_AT, GraphRunner, compare, sample_batch, torch_reference

        info = source.info
        runner = GraphRunner(folder / names.graph_file(ROLE), range(0, info.num_layers), info.num_kv_heads,
                             info.head_dim)
        ids, mask, pos = sample_batch(info.vocab_size, seed=3)
        want, _ = torch_reference(source, ids, mask, pos, info.num_layers, None)
        want_streams = self._reference_streams(source, ids, mask, pos)
        logits, rest = runner.run(ids, mask, pos)
        _, kv = runner.run(ids[:, :SPLIT_AT], mask[:, :SPLIT_AT], pos[:, :SPLIT_AT])
        cached, rest2 = runner.run(ids[:, SPLIT_AT:], mask, pos[:, SPLIT_AT:], kv[1:])
        rows = np.ones(want_streams.shape[:2], np.int64)
        worst = max((compare(CHECKS[2], got, want_streams, rows) for got in (rest[0], rest2[0])),
                    key=lambda c: c.max_abs_diff)
        return [compare(CHECKS[0], logits, want, mask), compare(CHECKS[1], cached, want[:, SPLIT_AT:],
                                                                mask[:, SPLIT_AT:]), worst]

    def _reference_streams(self, source, ids, mask, pos) -> np.ndarray:
        module = self.module(source)
        n, last = self.config.streams, ids.shape[1] - 1
        with torch.no_grad():
            mask_t, pos_t = torch.from_numpy(mask), torch.from_numpy(pos)
            h_f = module.trunk(torch.from_numpy(ids), mask_t, pos_t)
            _, streams = module.top(h_f, mask_t, pos_t, torch.full((n,), last), torch.arange(n))
            return module.head(streams).numpy()  # [B, n, V]


def detect(draft_path, source) -> Graph | None:
    """The streaming graph of a ``mirrorsd-train-draft`` folder, or None for an ordinary draft."""
    if not is_streaming_draft(draft_path):
        return None
    config, embeddings = load_streams(draft_path, source.info)
    return Graph(config, embeddings)
