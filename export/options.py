"""The options of ``mirrorsd-export``, defined once: the CLI takes its flags' defaults from here (no torch needed)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOP_K = 8


@dataclass(frozen=True)
class ExportOptions:
    model: Path
    output: Path
    draft: Path | None = None
    draft_layers: int | None = None
    exit_layer: int | None = None  # default: half the target's depth, or the latency model's choice (below)
    exit_hits: Path | None = None  # with exit_profile: pick the exit layer (export/exit_choice.py)
    exit_profile: Path | None = None
    top_k: int = DEFAULT_TOP_K
    force: bool = False
    trust_remote_code: bool = False
    static_draft: bool = False  # also write draft_static.onnx: fixed KV capacity and step width (NPUs)
    max_context: int | None = None  # the static draft's KV slots (default: min(1024, draft positions))
    target_precision: str = "fp32"  # fp32 | fp16 | int8 | int4 (weight-only; see quantize.py)
    draft_precision: str = "fp32"
    gguf_blocks: str = "exact"  # a GGUF source's blocks: exact | widen | widen-head | requantize (export/gguf_blocks.py)
    draft_gguf_blocks: str | None = None  # the draft's, when it differs (None: gguf_blocks)
    embedding: str = "quantized"  # a quantized model's token embedding: quantized | float (export/embedding.py)
    weight_storage: str = "plain"  # carried GGUF weights on disk: plain | packed (export/packed_weights.py)
    draft_weight_storage: str | None = None  # the draft's, when it differs (None: weight_storage)
    draft_vocab: int | None = None  # the draft's LM head scores only the N most likely ids (export/vocab_subset.py)
    resume: bool = False  # keep the scratch folder if the run stops; continue one a stopped run kept
    whole_graphs: bool = False  # trace each graph whole with all weights in memory (the exporter before streaming)
