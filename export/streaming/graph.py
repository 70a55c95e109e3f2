"""Streaming draft graph (role ``draft_streaming``): the draft plus n stream slots hung on its last new token.

    input_ids [B,S], attention_mask [B,P+S], position_ids [B,S], past_key_values.i.key/value [B,h,P,D]  (= draft)
      -> logits          [B,S,V]    main stream: row s predicts the token after input s (checks the lookahead)
      -> stream_logits   [B,n,V]    stream j = 1..n predicts the token j + 1 after the last input (next lookahead)
      -> present.i.key/value [B,h,P+S,D]   main slots only: streams keep no KV
The inputs and the KV are draft.onnx's, so one cache serves both graphs; n is fixed in the file (static-shape
friendly). Written when ``mirrorsd-export --draft`` points at a folder from ``mirrorsd-train-draft``.
"""
from __future__ import annotations

import numpy as np
import torch

from mirrorsd import names
from mirrorsd.manifest import TensorSpec
from mirrorsd.export.graphs.base import FP32, Traced
from mirrorsd.export.graphs.common import GraphIO, ids_input, kv_spec, kv_tensors, logits_tensor, step_inputs
from mirrorsd.export.streaming.model import StreamingConfig, StreamingDraft, is_streaming_draft, load_streams

ROLE = names.DRAFT_STREAMING
MODEL = "draft"
CHECKS = {"draft_streaming_logits": FP32,  # main stream vs the plain PyTorch draft
          "draft_streaming_cached_logits": FP32,  # the same in two chunks
          "draft_streaming_stream_logits": FP32}  # streams vs the training path of the same module
QUANTIZED, QUANT_EFFECT = True, None  # it shares draft.onnx's KV cache: same weights, same precision


class Graph:
    """The graph module protocol of ``export/graphs`` (graphs/base.py), holding the trained streams."""

    ROLE, MODEL, CHECKS, QUANTIZED, QUANT_EFFECT = ROLE, MODEL, CHECKS, QUANTIZED, QUANT_EFFECT

    def __init__(self, config: StreamingConfig, embeddings: torch.Tensor) -> None:
        self.config, self.embeddings = config, embeddings

    def module(self, model, arch) -> StreamingDraft:
        return StreamingDraft(model, arch, self.embeddings, self.config.stream_layers).eval()

    def build(self, source, exit_layer: int, top_k: int) -> Traced:
        info = source.info
        kv = kv_spec(0, info.num_layers, info.num_kv_heads, info.head_dim)
        past, present = kv_tensors(kv)
        streams = TensorSpec(names.STREAM_LOGITS, "float32", (names.BATCH, self.config.streams, info.vocab_size))
        io = GraphIO(tuple(step_inputs(ids_input()) + past), (logits_tensor(info.vocab_size), streams, *present), kv)
        return Traced(lambda model: self.module(model, source.arch), io, (0, info.num_layers))

    def validate(self, v) -> list:
        """Main logits vs the plain PyTorch draft; stream logits, whole and after a cached chunk, vs the module's
        training path (streams on explicit anchors, no KV): the two code paths must agree."""
        from mirrorsd.export.validate import SPLIT_AT, chunked, compare, sample_batch, torch_reference

        source = v.source
        info = source.info
        ids, mask, pos = sample_batch(info.vocab_size, seed=3)
        want, _ = torch_reference(source, ids, mask, pos, info.num_layers, None)
        with source.weights.materialized() as model:
            want_streams = self._reference_streams(model, source.arch, ids, mask, pos)
        out = v.runner.run(chunked(names.INPUT_IDS, (ids, ids[:, :SPLIT_AT], ids[:, SPLIT_AT:]), mask, pos))
        rows, streams = np.ones(want_streams.shape[:2], np.int64), "draft_streaming_stream_logits"
        worst = max((compare(streams, out[run][names.STREAM_LOGITS], want_streams, rows, CHECKS[streams])
                     for run in ("full", "b")), key=lambda c: c.max_abs_diff)
        return [compare("draft_streaming_logits", out["full"][names.LOGITS], want, mask,
                        CHECKS["draft_streaming_logits"]),
                compare("draft_streaming_cached_logits", out["b"][names.LOGITS], want[:, SPLIT_AT:],
                        mask[:, SPLIT_AT:], CHECKS["draft_streaming_cached_logits"]), worst]

    def _reference_streams(self, model, arch, ids, mask, pos) -> np.ndarray:
        module = self.module(model, arch)
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
