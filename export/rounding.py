"""Round-to-nearest with a searched scale, for fp16/bf16/fp32 sources: the same MatMulNBits layout as quantize.py
(symmetric, block 32, no zero points: fast on every host), with each block's scale chosen to minimise its
error instead of taken from its largest magnitude.

    search "mse"     per block of 32: s = max|w| / d for d on a grid; keep the s whose codes
                     c = clip(round(w / s), -2^(b-1), 2^(b-1) - 1) minimise  sum_k (w_k - s c_k)^2
    search "data"    the same, weighted by the mean square of each input channel's activation on the shipped
                     calibration text: sum_k E[x_k^2] (w_k - s c_k)^2, i.e. the block's contribution to the output
                     error (activation-aware scale estimation); the statistics come from the source model in
                     PyTorch (calibration.py)
    head_bits 8      the LM head (the MatMul whose N is the vocabulary) at 8 bits, the rest at the export's bits

Used by ``mirrorsd quantize`` (requantize.py) through ``quantize_model(..., rounding=...)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirrorsd.errors import ExportOptionError
from mirrorsd.export.gguf_blocks import BLOCK, Carried, pack

SEARCHES = ("none", "mse", "data")
GRID = np.linspace(6.0, 9.0, 13, dtype=np.float32)  # divisors of max|w| tried for 4 bits; scaled for 8 (below)
ROWS_PER_CHUNK = 64  # rows searched at once: temporaries of rows x K floats stay in the caches


@dataclass(frozen=True)
class RoundingOptions:
    search: str = "none"  # none (ONNX Runtime's quantizer, the default) | mse | data
    head_bits: int | None = None  # None: the LM head at the export's bits; 8: at 8 bits
    vocab_size: int | None = None  # identifies the LM head (its N)
    importance: dict | None = None  # data search: weight name -> E[x^2] per input channel [K]

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ExportOptionError(f"--scale-search {self.search!r} is not a search",
                                    f"choose one of {', '.join(SEARCHES)}", "for example --scale-search mse")
        if self.head_bits not in (None, 4, 8):
            raise ExportOptionError(f"--head-bits {self.head_bits} is not supported", "choose 4 or 8",
                                    "for example --head-bits 8")

    @property
    def active(self) -> bool:
        return self.search != "none" or self.head_bits is not None


def quantize_weight(weight: np.ndarray, bits: int, search: str, importance: np.ndarray | None = None) -> Carried:
    """weight [K, N] (a MatMul's B) -> MatMulNBits codes and scales. ``search``: "absmax" (s = max|w| / 2^(b-1)),
    "mse" or "data" (each block's scale searched as above; "data" needs ``importance`` [K], else it is "mse")."""
    k, n = weight.shape
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    rows = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    grid = np.asarray([-lo], np.float32) if search == "absmax" else GRID * np.float32(1 << (bits - 4))
    weights = None if importance is None or search != "data" else \
        np.asarray(importance, np.float32).reshape(1, k // BLOCK, BLOCK)
    scales = np.empty(rows.shape[:2], np.float32)
    for start in range(0, n, ROWS_PER_CHUNK):
        part = rows[start:start + ROWS_PER_CHUNK]  # [r, nb, 32]
        peak = np.abs(part).max(axis=-1)  # [r, nb]
        best_err = np.full(peak.shape, np.inf, np.float32)
        best = np.zeros(peak.shape, np.float32)
        work = np.empty_like(part)
        for divisor in grid:
            s = peak / divisor
            work = _codes(part, s, lo, hi, work)
            work *= s[..., None]
            np.subtract(part, work, out=work)
            work *= work
            if weights is not None:
                work *= weights
            total = work.sum(axis=-1)
            better = total < best_err
            best_err[better], best[better] = total[better], s[better]
        scales[start:start + ROWS_PER_CHUNK] = best
    codes = (_codes(rows, scales, lo, hi) - lo).astype(np.uint8)
    return Carried(bits, pack(codes, bits), scales)


def _codes(rows: np.ndarray, scales: np.ndarray, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
    """clip(rint(w / s)) as float32 [r, nb, 32] (w times 1/s: the search and the result round alike; s = 0 -> 0)."""
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)[..., None]
    out = np.multiply(rows, inverse, out=out)
    np.rint(out, out=out)
    return np.clip(out, lo, hi, out=out)


def round_matmuls(model, options: RoundingOptions, bits: int, accuracy_level: int) -> int:
    """Replace each MatMul with an initializer weight by MatMulNBits from ``quantize_weight``; returns how many."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    replaced = 0
    for index, node in enumerate(list(graph.node)):
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        if name not in inits or len(inits[name].dims) != 2:
            continue
        weight = numpy_helper.to_array(inits[name])  # [K, N]
        k, n = weight.shape
        if k % BLOCK:
            continue
        head = options.vocab_size is not None and n == options.vocab_size
        node_bits = options.head_bits if head and options.head_bits else bits
        importance = (options.importance or {}).get(name.removesuffix(".T"))
        found = quantize_weight(weight, node_bits, "absmax" if options.search == "none" else options.search,
                                importance)
        out = (f"{name}_Q{node_bits}", f"{name}_scales")
        graph.initializer.remove(inits.pop(name))
        graph.initializer.extend([numpy_helper.from_array(found.packed, out[0]),
                                  numpy_helper.from_array(found.scales, out[1])])
        graph.node.remove(node)
        graph.node.insert(index, helper.make_node(
            "MatMulNBits", [node.input[0], *out], list(node.output), name=f"{node.name}_Q{node_bits}",
            domain="com.microsoft", K=k, N=n, bits=node_bits, block_size=BLOCK, accuracy_level=accuracy_level))
        replaced += 1
    if replaced and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return replaced
