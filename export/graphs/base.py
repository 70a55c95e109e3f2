"""The protocol every graph module of ``export/graphs`` follows, and the two ways a graph is built.

A graph module (prefix.py, exit_head.py, suffix.py, draft.py, draft_static.py, streaming/graph.py) owns:
    ROLE          its name in the manifest and its file stem
    MODEL         "target" or "draft": whose weights it holds
    CHECKS        {check name: (atol, rtol)}: what its validation measures against PyTorch, and the tolerance
    QUANTIZED     whether --precision int8/int4 applies to it
    QUANT_EFFECT  the model ("target"/"draft") whose quantization effect on logits it records, or None
    build(source, exit_layer, top_k) -> Stack | Traced
    validate(v: validate.Validation) -> list[Check]
The pipeline and ``mirrorsd quantize`` iterate over the modules; nothing else names a check or a role.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mirrorsd.export.graphs.common import GraphIO

# The kinds of piece a Stack is made of (templates.py traces each once per model).
STEM_IDS, STEM_HIDDEN, LAYER, HEAD_LOGITS, HEAD_TOPK = "stem.ids", "stem.hidden", "layer", "head.logits", "head.topk"

Tolerance = tuple[float, float]  # (atol, rtol): a check passes when max |onnx - torch| <= atol + rtol * max |torch|
FP32 = (1e-4, 1e-4)  # fp32 ONNX vs fp32 PyTorch differ only by kernel summation order


@dataclass(frozen=True)
class Stack:
    """A graph made of pieces (templates.py), built layer by layer: stem, decoder layers [first, end), head."""

    io: GraphIO
    layer_range: tuple[int, int]
    stem: str | None  # STEM_IDS | STEM_HIDDEN | None
    head: str | None  # HEAD_LOGITS | HEAD_TOPK | None
    top_k: int = 0
    static_shapes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Traced:
    """A graph traced whole from a PyTorch module; ``make(model)`` runs while all of the model's weights are loaded."""

    make: Callable[[Any], Any]
    io: GraphIO
    layer_range: tuple[int, int]
    static_shapes: dict[str, int] = field(default_factory=dict)


class GraphModule(Protocol):
    ROLE: str
    MODEL: str
    CHECKS: Mapping[str, Tolerance]
    QUANTIZED: bool
    QUANT_EFFECT: str | None

    def build(self, source, exit_layer: int, top_k: int) -> Stack | Traced: ...

    def validate(self, v) -> list: ...
