"""Carry a GGUF file's quantized blocks into MatMulNBits where they map exactly, instead of dequantizing them to
float32 and quantizing them again (a second rounding on top of the file's own).

MatMulNBits stores, for each output column n and each block of 32 along K, unsigned codes c, one float32 scale s and
optionally one float32 zero point zp, and means w = (c - zp) * s, with zp = 2^(bits-1) when no zero-point input is
given. mirrorsd's kernels (devices/kernels: bits 4 or 8, block 32, no zero points or float ones) compute both forms
row-invariantly, so carried weights change nothing the kernels need for bitwise batch invariance. A GGUF block
format maps bitwise when its weight is d * (integer) with one fp16 d per 32 weights (d is exact in float32 and the
product rounds the same way as gguf's own dequantization); Q4_K maps with a float zero point, equal up to float
rounding:

    GGUF type   its weight (per block of 32)             maps onto             codes c, scale s, zero point
    Q4_0        d * (q - 8),   q in 0..15                4-bit, 8-bit, exact   q | q + 120,  d
    Q5_0        d * (q - 16),  q in 0..31                8-bit, exact          q + 112,      d
    Q8_0        d * q,         q in -128..127            8-bit, exact          q + 128,      d
    Q4_K        d*sc_j * q - dmin*m_j, q in 0..15        4-bit, float zero     q,  s = d*sc_j,  zp = dmin*m_j / s
                (6-bit sc_j, m_j per sub-block j of 32)  point, not bitwise    (sc_j = 0: c = 0, s = dmin*m_j, zp = 1)
    Q5_K        as Q4_K with q in 0..31                  no: 8 bits with a float zero point, which ONNX Runtime's CPU
                                                         kernel refuses (export validation and hosts without
                                                         mirrorsd's kernels would fail to load the graph)
    Q4_1, Q5_1  d * q + m      (a float offset)          no (not carried yet: they would map as Q4_K does)
    Q6_K        d*sc_j * (q - 32) per 16 (int8 sc_j): two scales in one block of 32; no
    Q2_K, Q3_K, IQ*: no

Q4_K's d*sc_j and dmin*m_j are exact in float32 (an fp16 times a 6-bit integer); gguf computes d*sc_j * q - dmin*m_j
with one rounding, ONNX Runtime c*s - zp*s and mirrorsd's kernel s * sum (c - 8) q + (8 - zp) * s * sum q, so the
carried weights differ from gguf's by a few float32 roundings of the block's magnitude (tests/test_gguf_blocks.py
states the bound), never by a second quantization step.

Modes (``mirrorsd-export --gguf-blocks``):
    exact       carry a tensor whose format maps onto the export's own bit width (int4: Q4_0, Q4_K; int8: Q4_0,
                Q5_0, Q8_0); requantize the others from their dequantized values (the default)
    widen       in an int4 export, keep at 8 bits what the file holds at more than 4 bits: carry what maps onto 8
                bits (Q5_0, Q8_0), and requantize Q5_1, Q5_K and Q6_K at 8 bits (symmetric round-to-nearest of
                their dequantized values, counted as gguf_widened.TYPE) instead of at 4. Larger; the file's own
                mix of precisions (a Q4_K_M file keeps its LM head and half its down projections at 6 bits)
    requantize  dequantize and quantize every tensor again (the exporter before this module)
A row permutation that transformers applies when it reads a GGUF (Llama's q/k rows) is applied to the blocks too.
Storage (``--weight-storage``): plain writes the MatMulNBits initializers above; packed writes a carried Q4_K
tensor's scales, and a Q6_K tensor widened to 8 bits whole, as the file's own bytes plus the standard ONNX operators
that rebuild the same initializers at load (export/packed_weights.py).

The source may be the GGUF itself, or a Hugging Face folder that ``mirrorsd fetch`` converted from one (its
mirrorsd_source.json names the file, export/convert.py: converted_from): that folder's weights are the GGUF's own
dequantized values, so the blocks are carried from the file it came from (the pinned demo models export this way).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mirrorsd.errors import ExportOptionError
from mirrorsd.names import FLOAT_ZERO_POINT_WEIGHTS, WEIGHT_BITS

MODES = ("exact", "widen", "widen-head", "requantize")
WIDE_ROLES = ("suffix",)  # widen-head: the graph whose LM head makes the target's logits (the output's precision)
BLOCK = 32
# GGUF type -> MatMulNBits bit widths it maps onto (Q4_K: with float zero points, which ONNX Runtime's CPU kernel
# takes at 4 bits only)
EXACT_BITS = {"Q4_0": (4, 8), "Q5_0": (8,), "Q8_0": (8,), "Q4_K": (4,)}
WIDENED = ("Q5_1", "Q5_K", "Q6_K")  # more than 4 bits per weight, no exact map: 8 bits under --gguf-blocks widen
SCALE_BYTES = 2  # every format above starts its block with d as fp16
SUPER_BLOCK = 256  # weights per K-quant block: 8 sub-blocks of 32
K_QUANTS = ("Q4_K", "Q5_K")  # read by k_quant_parts (Q5_K: not carried, see the table above)


def check_mode(value: str) -> str:
    if value not in MODES:
        raise ExportOptionError(f"--gguf-blocks {value!r} is not a mode", f"choose one of {', '.join(MODES)}",
                                "for example --gguf-blocks exact")
    return value


@dataclass(frozen=True)
class Carried:
    """A weight's MatMulNBits form: codes ``packed`` [N, K/32, 32*bits/8] uint8, ``scales`` [N, K/32] float32, and
    ``zero_points`` [N, K/32] float32 or None (then w = (c - 2^(bits-1)) * s)."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None
    stored: object = None  # packed_weights.PackedQ4K / PackedQ6K: what packed storage writes instead (else None)


@dataclass
class BlockPlan:
    """Decides, tensor by tensor, whether a MatMul weight is carried from the GGUF or requantized; counts both
    per graph role (``report``) for the manifest, and the carried weights with float zero points
    (names.FLOAT_ZERO_POINT_WEIGHTS)."""

    weights: object  # LazyWeights over a GGUFReader
    bits: int  # the export's bit width (4 or 8)
    mode: str
    counts: dict = field(default_factory=dict)  # role -> Counter({"gguf_carried.Q4_0": n, ...})
    vocab_size: int | None = None  # the LM head's N: what mode widen-head widens
    storage: str = "plain"  # plain | packed: Q4_K scales and widened Q6_K as the file's bytes (packed_weights.py)

    def carry(self, role: str, parameter: str) -> Carried | None:
        """The carried form of model parameter ``parameter`` ([N, K] in the model), or None to requantize it."""
        reader = self.weights.reader
        stored = self.weights.sources.get(parameter)
        if stored is None or stored not in reader.tensors:
            return None
        tensor = reader.tensors[stored]
        kind = tensor.tensor_type.name
        wide = self.mode == "widen" or (self.mode == "widen-head" and role in WIDE_ROLES
                                        and reader.shape(stored)[0] == self.vocab_size)
        bits = self._bits(kind, wide)
        result = carried(reader, stored, bits, self.storage == "packed") if bits else None
        tally = self.counts.setdefault(role, Counter())
        if (result is not None or kind in WIDENED) and not self._same_values(stored):
            tally[f"gguf_differs.{kind}"] += 1  # the folder's weight is not the file's: requantize the folder's
            return None
        if result is None and wide and self.bits == 4 and kind in WIDENED and reader.shape(stored)[1] % BLOCK == 0:
            tally[f"gguf_widened.{kind}"] += 1
            widened = round_to_8_bits(reader.get(stored).numpy())
            if self.storage == "packed" and kind == "Q6_K":
                widened = packed_q6_k(reader, stored, widened)
            return widened
        tally[f"gguf_carried.{kind}" if result else f"gguf_requantized.{kind}"] += 1
        if result is not None and result.zero_points is not None:
            tally[FLOAT_ZERO_POINT_WEIGHTS] += 1
        return result

    def _same_values(self, stored: str) -> bool:
        """Whether the source's tensor equals the GGUF's dequantization (always, when the source is the GGUF; a
        converted folder is checked tensor by tensor: it may have been edited since)."""
        folder = getattr(self.weights, "folder", None)
        return folder is None or np.array_equal(folder.get(stored).numpy(), self.weights.reader.get(stored).numpy())

    def _bits(self, kind: str, wide: bool) -> int | None:
        if self.mode == "requantize":
            return None
        maps = EXACT_BITS.get(kind, ())
        if self.bits in maps:
            return self.bits
        return 8 if wide and 8 in maps else None

    def report(self, role: str) -> dict[str, float]:
        return {k: float(v) for k, v in sorted(self.counts.get(role, {}).items())}


@dataclass(frozen=True)
class ConvertedWeights:
    """The GGUF a Hugging Face folder was converted from, seen under the folder's parameter names."""

    reader: object  # checkpoint.GGUFReader
    sources: dict  # model parameter -> the folder's tensor name (the same HF names the GGUF reader maps to)
    folder: object  # the folder's own reader (checkpoint.SafetensorsReader)


def block_plan(source, precision: str, mode: str, storage: str = "plain") -> BlockPlan | None:
    """A plan when ``source`` reads a GGUF file, or a folder converted from one that is still in the cache, and
    ``precision`` quantizes; else None (nothing to carry)."""
    from mirrorsd.export.checkpoint import GGUFReader, open_gguf
    from mirrorsd.export.convert import converted_from

    weights = getattr(source, "weights", None)
    if precision not in WEIGHT_BITS or weights is None:
        return None
    if not isinstance(weights.reader, GGUFReader):
        origin = converted_from(source.path) if mode != "requantize" and Path(source.path).is_dir() else None
        if origin is None:
            return None
        weights = ConvertedWeights(open_gguf(origin, source.model), weights.sources, weights.reader)
    return BlockPlan(weights, WEIGHT_BITS[precision], check_mode(mode), vocab_size=source.info.vocab_size,
                     storage=storage)


def round_to_8_bits(weight: np.ndarray) -> Carried:
    """[N, K] float32 (K a multiple of 32) -> 8-bit MatMulNBits weights: per block of 32, s = max|w| / 127 and
    c = round_half_even(w / s) + 128 (an all-zero block: s = 0, c = 128)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    scales = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)  # [N, K/32]
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(blocks / safe[..., None]), -127, 127) + 128
    return Carried(8, codes.astype(np.uint8), scales)


def packed_q6_k(reader, stored: str, widened: Carried) -> Carried:
    """``widened`` (a Q6_K tensor rounded to 8 bits) with the file's own blocks to store instead, where its rows are
    the file's in some order and K is whole super-blocks (else as it is)."""
    from mirrorsd.export.packed_weights import q6k_from_blocks

    n, k = reader.shape(stored)
    order = row_order(reader, stored, n)
    if k % SUPER_BLOCK or order is None:
        return widened
    blocks = np.asarray(reader.tensors[stored].data).reshape(n, k // SUPER_BLOCK, -1)[order]
    return Carried(widened.bits, widened.packed, widened.scales, None, q6k_from_blocks(blocks))


def carried(reader, stored: str, bits: int, keep_blocks: bool = False) -> Carried | None:
    """Tensor ``stored`` of the GGUF (HF name) as MatMulNBits codes and scales, or None if its rows are not a
    permutation of the file's (then it is requantized). ``keep_blocks``: a Q4_K tensor also keeps its scale bytes
    for packed storage."""
    tensor = reader.tensors[stored]
    n, k = reader.shape(stored)
    kind = tensor.tensor_type.name
    weights_per_block = SUPER_BLOCK if kind in K_QUANTS else BLOCK
    if k % weights_per_block:
        return None
    blocks = np.asarray(tensor.data).reshape(n, k // weights_per_block, -1)  # [N, blocks, bytes per block]
    order = row_order(reader, stored, n)
    if order is None:
        return None
    blocks = blocks[order]
    if kind in K_QUANTS:
        codes, scales, zero_points = with_zero_points(*k_quant_parts(blocks, kind))
        stored_form = None
        if keep_blocks and kind == "Q4_K":
            from mirrorsd.export.packed_weights import q4k_from_blocks

            stored_form = q4k_from_blocks(blocks)
        return Carried(bits, pack(codes, bits), scales, zero_points, stored_form)
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


def k_quant_parts(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks [N, nb, bytes] -> per sub-block of 32: codes q [N, nb*8, 32] uint8, scales d*sc_j and
    offsets dmin*m_j [N, nb*8] float32 (both exact), so that gguf's weight is scale * q - offset.

    A block: d fp16 | dmin fp16 | 12 bytes of 6-bit sc_j, m_j | (Q5_K: 32 bytes, bit j of byte i = bit 4 of
    weight i of sub-block j) | 128 bytes, byte i of group g: weight i of sub-block 2g (low nibble), of 2g+1 (high)."""
    n, nb, _ = blocks.shape
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, m = sub_block_scales(blocks[..., 4:16])  # [N, nb, 8] each
    high = blocks[..., 16:48] if kind == "Q5_K" else None
    low = blocks[..., 48:176] if kind == "Q5_K" else blocks[..., 16:144]
    low = low.reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (low & 0x0F).reshape(n, nb, 8, 32)  # sub-blocks 2g, 2g+1 of group g
    if high is not None:
        bit = high.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((bit & 1) << 4)
    scales = d[..., None] * sc.astype(np.float32)  # [N, nb, 8]
    offsets = dmin[..., None] * m.astype(np.float32)
    return q.reshape(n, nb * 8, BLOCK).astype(np.uint8), scales.reshape(n, -1), offsets.reshape(n, -1)


def sub_block_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes [..., 12] of a K-quant block -> its 6-bit sc_j and m_j [..., 8] (j = sub-block). Bytes 0-3 hold
    sc_0..3 and bytes 4-7 m_0..3 in their low 6 bits; bytes 8-11 hold the low 4 bits of sc_4..7 (low nibble) and of
    m_4..7 (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    first, second, last = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 0x3F, (last & 0x0F) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 0x3F, (last >> 4) | ((second >> 6) << 4)], axis=-1)
    return sc, m


def with_zero_points(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray):
    """scale * q - offset per block as MatMulNBits' (c - zp) * s: c = q, s = scale, zp = offset / scale. A block of
    scale 0 is the constant -offset: codes 0, s = offset, zp = 1 (or all zero when the offset is 0 too)."""
    constant = scales == 0
    safe = np.where(constant, 1.0, scales).astype(np.float32)
    zero_points = np.where(constant, np.where(offsets != 0, 1.0, 0.0), offsets / safe).astype(np.float32)
    codes = np.where(constant[..., None], 0, codes).astype(np.uint8)
    return codes, np.where(constant, offsets, scales).astype(np.float32), zero_points


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


def dequantize_nbits(packed: np.ndarray, scales: np.ndarray, bits: int,
                     zero_points: np.ndarray | None = None) -> np.ndarray:
    """MatMulNBits' weights [N, K] as the operator defines them: (c - zp) * s in float32, zp = 2^(bits-1) when
    ``zero_points`` (one float per scale) is None."""
    n = packed.shape[0]
    center = np.float32(1 << (bits - 1)) if zero_points is None else \
        zero_points.reshape(n, -1, 1).astype(np.float32)
    codes = unpack(packed, bits).astype(np.float32) - center
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
    kept = []  # the graph's nodes in order, each carried MatMul replaced by its unpacking nodes and MatMulNBits
    for original in graph.node:
        node = type(original)()
        node.CopyFrom(original)  # kept apart from the graph, which is rebuilt from ``kept`` at the end
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else ""
        found = None
        if weight in inits and weight.endswith(".T"):
            k, n = (int(d) for d in inits[weight].dims)
            found = plan.carry(role, weight[:-2])
        if found is None or found.packed.shape[0] != n or found.scales.shape[1] * BLOCK != k:
            kept.append(node)
            continue
        names = [f"{weight}_Q{found.bits}", f"{weight}_scales"]
        if found.zero_points is not None:  # input 3, [N * K/32] as ONNX Runtime's contrib-op spec shapes it
            names.append(f"{weight}_zero_points")
        graph.initializer.remove(inits.pop(weight))
        unpacking = _unpacking(found, names, weight, n, k)
        if unpacking is None:
            graph.initializer.append(numpy_helper.from_array(found.packed, names[0]))
            graph.initializer.append(numpy_helper.from_array(found.scales, names[1]))
            if found.zero_points is not None:
                graph.initializer.append(numpy_helper.from_array(found.zero_points.reshape(-1), names[2]))
        else:
            graph.initializer.extend(unpacking.initializers)
            kept.extend(unpacking.nodes)
        kept.append(helper.make_node("MatMulNBits", [node.input[0], *names], list(node.output),
                                     name=f"{node.name}_Q{found.bits}", domain="com.microsoft", K=k, N=n,
                                     bits=found.bits, block_size=BLOCK, accuracy_level=accuracy_level))
        replaced += 1
    if replaced:
        del graph.node[:]
        graph.node.extend(kept)
    if replaced and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return replaced


def _unpacking(found: Carried, names: list[str], weight: str, n: int, k: int):
    """The unpacking nodes and stored initializers of a packed weight (packed_weights.py), or None to store it
    plain. Q4_K keeps its codes as initializer ``names[0]``."""
    from onnx import numpy_helper

    from mirrorsd.export.packed_weights import PackedQ4K, PackedQ6K, q4k_matmul_nodes, q6k_8bit_nodes

    if isinstance(found.stored, PackedQ4K):
        built = q4k_matmul_nodes(weight, found.stored, n, k, names[1], names[2])
        built.initializers.append(numpy_helper.from_array(found.packed, names[0]))
        return built
    if isinstance(found.stored, PackedQ6K):
        return q6k_8bit_nodes(weight, found.stored, n, k, names[0], names[1])
    return None
