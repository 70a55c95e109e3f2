"""Carry a GGUF file's quantized blocks into MatMulNBits where they map exactly, instead of dequantizing them to
float32 and quantizing them again (a second rounding on top of the file's own).

MatMulNBits without a zero-point input stores, for each output column n and each block of 32 along K, unsigned codes
c and one float32 scale s, and means w = (c - 2^(bits-1)) * s. That is also all that mirrorsd's kernels take
(devices/kernels: bits 4 or 8, block 32, no zero points), so carried weights change nothing the kernels need for
bitwise batch invariance. A GGUF block format maps exactly when its weight is d * (integer) with one fp16 d per
32 weights; d is exact in float32 and the product rounds the same way as gguf's own dequantization:

    GGUF type   its weight (per block of 32)            maps onto          codes c (scale s = d)
    Q4_0        d * (q - 8),   q in 0..15               4-bit, 8-bit       q       | q + 120
    Q5_0        d * (q - 16),  q in 0..31               8-bit              q + 112
    Q8_0        d * q,         q in -128..127           8-bit              q + 128
    Q4_1, Q5_1  d * q + m      (a float offset)         no: needs a float zero point, which the kernels refuse
    Q4_K, Q5_K  d*sc_j * q - dmin*m_j per 32 (6-bit sc_j, m_j): the same float offset per sub-block; no
    Q6_K        d*sc_j * (q - 32) per 16 (int8 sc_j): two scales in one block of 32; no
    Q2_K, Q3_K, IQ*: no

Modes (``mirrorsd-export --gguf-blocks``):
    exact       carry a tensor whose format maps onto the export's own bit width (int4: Q4_0; int8: Q4_0, Q5_0,
                Q8_0); requantize the others from their dequantized values (the default)
    widen       also carry at 8 bits what maps only onto 8 bits in an int4 export (Q5_0, Q8_0): larger than 4 bits,
                without the second rounding
    requantize  dequantize and quantize every tensor again (the exporter before this module)
A row permutation that transformers applies when it reads a GGUF (Llama's q/k rows) is applied to the blocks too.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.errors import ExportOptionError
from mirrorsd.names import WEIGHT_BITS

MODES = ("exact", "widen", "requantize")
BLOCK = 32
EXACT_BITS = {"Q4_0": (4, 8), "Q5_0": (8,), "Q8_0": (8,)}  # GGUF type -> MatMulNBits bit widths it maps onto
SCALE_BYTES = 2  # every format above starts its block with d as fp16


def check_mode(value: str) -> str:
    if value not in MODES:
        raise ExportOptionError(f"--gguf-blocks {value!r} is not a mode", f"choose one of {', '.join(MODES)}",
                                "for example --gguf-blocks exact")
    return value


@dataclass(frozen=True)
class Carried:
    """A weight's MatMulNBits form: codes ``packed`` [N, K/32, 32*bits/8] uint8, ``scales`` [N, K/32] float32."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray


@dataclass
class BlockPlan:
    """Decides, tensor by tensor, whether a MatMul weight is carried from the GGUF or requantized; counts both
    per graph role (``report``) for the manifest."""

    weights: object  # LazyWeights over a GGUFReader
    bits: int  # the export's bit width (4 or 8)
    mode: str
    counts: dict = field(default_factory=dict)  # role -> Counter({"gguf_carried.Q4_0": n, ...})

    def carry(self, role: str, parameter: str) -> Carried | None:
        """The carried form of model parameter ``parameter`` ([N, K] in the model), or None to requantize it."""
        reader = self.weights.reader
        stored = self.weights.sources.get(parameter)
        if stored is None or stored not in reader.tensors:
            return None
        tensor = reader.tensors[stored]
        kind = tensor.tensor_type.name
        bits = self._bits(kind)
        result = carried(reader, stored, bits) if bits else None
        tally = self.counts.setdefault(role, Counter())
        tally[f"gguf_carried.{kind}" if result else f"gguf_requantized.{kind}"] += 1
        return result

    def _bits(self, kind: str) -> int | None:
        if self.mode == "requantize":
            return None
        maps = EXACT_BITS.get(kind, ())
        if self.bits in maps:
            return self.bits
        return 8 if self.mode == "widen" and 8 in maps else None

    def report(self, role: str) -> dict[str, float]:
        return {k: float(v) for k, v in sorted(self.counts.get(role, {}).items())}


def block_plan(source, precision: str, mode: str) -> BlockPlan | None:
    """A plan when ``source`` reads a GGUF file and ``precision`` quantizes; else None (nothing to carry)."""
    from mirrorsd.export.checkpoint import GGUFReader

    weights = getattr(source, "weights", None)
    if precision not in WEIGHT_BITS or weights is None or not isinstance(weights.reader, GGUFReader):
        return None
    return BlockPlan(weights, WEIGHT_BITS[precision], check_mode(mode))


def carried(reader, stored: str, bits: int) -> Carried | None:
    """Tensor ``stored`` of the GGUF (HF name) as MatMulNBits codes and scales, or None if its rows are not a
    permutation of the file's (then it is requantized)."""
    tensor = reader.tensors[stored]
    n, k = reader.shape(stored)
    if k % BLOCK:
        return None
    blocks = np.asarray(tensor.data).reshape(n, k // BLOCK, -1)  # [N, K/32, bytes per block]
    order = row_order(reader, stored, n)
    if order is None:
        return None
    blocks = blocks[order]
    scales = np.ascontiguousarray(blocks[..., :SCALE_BYTES]).view(np.float16)[..., 0].astype(np.float32)
    values = block_integers(blocks, tensor.tensor_type)  # [N, K/32, 32] int16
    codes = (values + (1 << (bits - 1))).astype(np.uint8)
    return Carried(bits, pack(codes, bits), scales)


def block_integers(blocks: np.ndarray, kind) -> np.ndarray:
    """The integer of every weight (its value / d), read with gguf's own dequantization of the blocks with d := 1."""
    from gguf import dequantize

    unit = blocks.copy()
    unit[..., :SCALE_BYTES] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    n, nb, _ = unit.shape
    values = dequantize(unit.reshape(n, -1), kind).reshape(n, nb, BLOCK)
    return values.astype(np.int16)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [N, nb, 32] uint8 -> MatMulNBits' B [N, nb, 32*bits/8]: 4-bit codes two per byte, even k low."""
    if bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' weights [N, K] as ONNX Runtime reads them: (c - 2^(bits-1)) * s in float32."""
    codes = unpack(packed, bits).astype(np.float32) - np.float32(1 << (bits - 1))
    n = packed.shape[0]
    return (codes * scales.reshape(n, -1, 1).astype(np.float32)).reshape(n, -1)


def row_order(reader, stored: str, n: int) -> np.ndarray | None:
    """Where each model row comes from in the file: the reader's processor applied to the row indices."""
    index = np.arange(n, dtype=np.float32).reshape(n, 1)
    try:
        moved = np.asarray(reader.processor.process(weights=index, name=reader.gguf_names[stored]).weights)
    except Exception:  # a processor that does more than move rows (it may reject the shape): requantize
        return None
    order = moved.reshape(-1).astype(np.int64)
    if moved.shape != (n, 1) or not np.array_equal(np.sort(order), np.arange(n)):
        return None
    return order


def replace_matmuls(model, plan: BlockPlan, role: str, accuracy_level: int) -> int:
    """Turn each MatMul whose weight initializer (``NAME.T``, the model's [N, K] stored as [K, N]) the plan carries
    into MatMulNBits over the carried blocks; returns how many. The quantizer then handles the remaining MatMuls."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    replaced = 0
    for index, node in enumerate(list(graph.node)):
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        if weight not in inits or not weight.endswith(".T"):
            continue
        k, n = (int(d) for d in inits[weight].dims)
        found = plan.carry(role, weight[:-2])
        if found is None or found.packed.shape[0] != n or found.scales.shape[1] * BLOCK != k:
            continue
        names = (f"{weight}_Q{found.bits}", f"{weight}_scales")
        graph.initializer.remove(inits.pop(weight))
        graph.initializer.extend([numpy_helper.from_array(found.packed, names[0]),
                                  numpy_helper.from_array(found.scales, names[1])])
        new = helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output),
                               name=f"{node.name}_Q{found.bits}", domain="com.microsoft", K=k, N=n,
                               bits=found.bits, block_size=BLOCK, accuracy_level=accuracy_level)
        graph.node.remove(node)
        graph.node.insert(index, new)
        replaced += 1
    if replaced and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return replaced
