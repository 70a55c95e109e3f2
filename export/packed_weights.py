"""Weights stored on disk at the GGUF file's own size, unpacked by standard ONNX operators that the host folds at load
(``mirrorsd-export --weight-storage packed``).

MatMulNBits keeps one float32 scale (and, for carried Q4_K, one float32 zero point) per block of 32 weights: 6 bits per
weight where the file's Q4_K has 4.5, and a Q6_K tensor widened to 8 bits takes 9 where the file has 6.56. Packed
storage writes what the file holds instead, and a few standard operators (Cast, Mul, Div, Mod, Where, Concat,
Reshape, ReduceMax, Round, Clip) compute MatMulNBits' inputs from it:

    carried Q4_K       codes [N, K/32, 16] uint8 as plain storage has them, plus per super-block of 256 weights
                       d, dmin (fp16 [N, K/256, 2]) and the 12 bytes of 6-bit sub-block scales and mins
                       ([N, K/256, 12] uint8): 4.5 bits per weight, the file's own bytes
                       -> scales [N, K/32] and zero points [N*K/32] float32 (embedding: scales and offsets)
    Q6_K at 8 bits     the file's 6-bit codes (low nibbles [N, K/2], two per byte; high 2 bits [N, K/4], four per
    (widen, widen-head) byte; consecutive weights), int8 scales per 16 ([N, K/16]) and fp16 d per 256 ([N, K/256]):
                       6.56 bits per weight -> gguf's dequantization (d*sc) * (q - 32), then the same symmetric
                       8-bit rounding as plain storage (gguf_blocks.round_to_8_bits)

Every value is bitwise the one plain storage writes: the products d*sc are exact in float32, and every other step is
one IEEE operation in the order numpy takes it (division and rounding are correctly rounded in both). So a packed
folder computes exactly what a plain one computes, and everything downstream (the kernels' batch invariance,
losslessness) is unchanged; tests/test_packed_weights.py compares the folded initializers bit for bit.

Who unpacks:
    mirrorsd's runtime   devices/unpack.py evaluates the ``unpack/...`` nodes with numpy, row chunk by row chunk, and
                         hands ONNX Runtime or OpenVINO the graph with plain initializers (the Qwen2.5-Coder 1.5B
                         suffix: seconds, and about its own size in temporary memory).
    any other host       ONNX Runtime's constant folding (every optimization level but "disable all") unpacks them
                         when the session is created, so C, C++ and C# hosts load the files as they are; it keeps
                         each temporary tensor until the whole graph is folded, so a large widened Q6_K head costs
                         gigabytes at load (docs/quality.md has the measurement). OpenVINO reads MatMulNBits only
                         with constant zero points: given the file, it refuses the graph; mirrorsd gives it the
                         unpacked bytes.
Unpacking nodes are named ``names.UNPACK_PREFIX...`` (devices/kernels/rewrite.py and devices/unpack.py read it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirrorsd.names import UNPACK_PREFIX  # every unpacking node's name starts with it (devices/kernels/rewrite.py)

STORAGES = ("plain", "packed")
SUPER_BLOCK = 256
BLOCK = 32


@dataclass(frozen=True)
class PackedQ4K:
    """A carried Q4_K tensor's scales as the file keeps them: ``d_dmin`` [N, nb, 2] float16, ``scale_bytes``
    [N, nb, 12] uint8 (nb = K / 256)."""

    d_dmin: np.ndarray
    scale_bytes: np.ndarray


@dataclass(frozen=True)
class PackedQ6K:
    """A Q6_K tensor as the file keeps it, in consecutive order: ``low`` [N, K/2] uint8 (q & 15, two per byte, even
    k low), ``high`` [N, K/4] uint8 (q >> 4, four per byte, k % 4 = 0 in the low bits), ``scales`` [N, K/16] int8,
    ``d`` [N, K/256] float16; weight = (d * scale) * (q - 32)."""

    low: np.ndarray
    high: np.ndarray
    scales: np.ndarray
    d: np.ndarray


def q4k_from_blocks(blocks: np.ndarray) -> PackedQ4K:
    """Q4_K blocks [N, nb, 144] (rows already in the model's order) -> their d, dmin and scale bytes."""
    d_dmin = np.ascontiguousarray(blocks[..., 0:4]).view(np.float16)  # [N, nb, 2]
    return PackedQ4K(d_dmin, np.ascontiguousarray(blocks[..., 4:16]))


def q6k_from_blocks(blocks: np.ndarray) -> PackedQ6K:
    """Q6_K blocks [N, nb, 210] -> PackedQ6K (the codes re-laid in consecutive order, the same 6 bits)."""
    from mirrorsd.export.q6_k import q6_k_parts

    n, nb, _ = blocks.shape
    q, _ = q6_k_parts(blocks)  # [N, K] 0..63
    low, high = q & 0x0F, q >> 4
    low = (low[:, 0::2] | (low[:, 1::2] << 4)).astype(np.uint8)
    high = (high[:, 0::4] | (high[:, 1::4] << 2) | (high[:, 2::4] << 4) | (high[:, 3::4] << 6)).astype(np.uint8)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, nb * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).reshape(n, nb)
    return PackedQ6K(np.ascontiguousarray(low), np.ascontiguousarray(high), np.ascontiguousarray(scales), d)


class _Builder:
    """Unpacking nodes and their constants, named under ``UNPACK_PREFIX + scope``."""

    def __init__(self, scope: str):
        self.scope = f"{UNPACK_PREFIX}{scope}/"
        self.nodes, self.initializers = [], []
        self._count = 0

    def const(self, name: str, value) -> str:
        from onnx import numpy_helper

        full = self.scope + name
        self.initializers.append(numpy_helper.from_array(np.asarray(value), full))
        return full

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        from onnx import helper

        self._count += 1
        out = output or f"{self.scope}{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{self.scope}{op_type}_{self._count}",
                                           **attrs))
        return out

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def reshape(self, x: str, shape, output: str | None = None) -> str:
        return self.op("Reshape", [x, self.const(f"shape_{self._count + 1}", np.array(shape, np.int64))], output)

    def slice_last(self, x: str, start: int, end: int) -> str:
        c, i = self.const, self._count + 1
        return self.op("Slice", [x, c(f"start_{i}", np.array([start], np.int64)),
                                 c(f"end_{i}", np.array([end], np.int64)), c(f"axis_{i}", np.array([-1], np.int64))])

    def u8_op(self, op_type: str, x: str, value: int) -> str:
        """``x`` (uint8) op a uint8 constant."""
        return self.op(op_type, [x, self.const(f"u8_{self._count + 1}", np.array(value, np.uint8))])

    def stack_last(self, parts: list[str]) -> str:
        axis = self.const(f"axis_{self._count + 1}", np.array([-1], np.int64))
        return self.op("Concat", [self.op("Unsqueeze", [p, axis]) for p in parts], axis=-1)


def q4k_scale_nodes(scope: str, n: int, k: int) -> tuple[_Builder, str, str, str, str]:
    """Nodes that compute a carried Q4_K tensor's per-32 ``scale`` d*sc_j and ``offset`` dmin*m_j, both [N, K/32]
    float32, from its stored d, dmin and scale bytes. Returns (builder, d_dmin name, bytes name, scale, offset)."""
    from onnx import TensorProto

    b = _Builder(scope)
    d_name, bytes_name = b.scope + "d_dmin", b.scope + "scale_bytes"
    raw = bytes_name  # [N, nb, 12] uint8; the arithmetic below stays in uint8 (every value fits)
    first, second, last = b.slice_last(raw, 0, 4), b.slice_last(raw, 4, 8), b.slice_last(raw, 8, 12)

    def six_bits(low_part: str, top_source: str, nibble: str) -> str:
        # bytes 0-3 (4-7): the low 6 bits of entries 0-3; entries 4-7: a nibble of bytes 8-11 | top 2 bits << 4
        top = b.u8_op("Mul", b.u8_op("Div", top_source, 64), 16)
        return b.op("Concat", [b.u8_op("Mod", low_part, 64), b.op("Add", [nibble, top])], axis=-1)  # [N, nb, 8]

    sc = six_bits(first, first, b.u8_op("Mod", last, 16))
    m = six_bits(second, second, b.u8_op("Div", last, 16))
    d_dmin = b.cast(d_name, TensorProto.FLOAT)  # [N, nb, 2]
    d, dmin = b.slice_last(d_dmin, 0, 1), b.slice_last(d_dmin, 1, 2)  # [N, nb, 1]
    scale = b.reshape(b.op("Mul", [d, b.cast(sc, TensorProto.FLOAT)]), [n, k // BLOCK])
    offset = b.reshape(b.op("Mul", [dmin, b.cast(m, TensorProto.FLOAT)]), [n, k // BLOCK])
    return b, d_name, bytes_name, scale, offset


def q4k_matmul_nodes(scope: str, packed: PackedQ4K, n: int, k: int, scales_out: str, zero_points_out: str) -> _Builder:
    """A carried Q4_K tensor's MatMulNBits scales [N, K/32] and zero points [N*K/32] (gguf_blocks.with_zero_points,
    the same operations: scale 0 -> s = offset and zp = 1, or 0 when the offset is 0 too; else zp = offset / s)."""
    from onnx import numpy_helper

    b, d_name, bytes_name, scale, offset = q4k_scale_nodes(scope, n, k)
    zero, one = b.const("zero", np.float32(0)), b.const("one", np.float32(1))
    constant = b.op("Equal", [scale, zero])
    ratio = b.op("Div", [offset, b.op("Where", [constant, one, scale])])
    lone = b.op("Where", [b.op("Equal", [offset, zero]), zero, one])
    b.reshape(b.op("Where", [constant, lone, ratio]), [-1], zero_points_out)
    b.op("Where", [constant, offset, scale], scales_out)
    b.initializers += [numpy_helper.from_array(packed.d_dmin, d_name),
                       numpy_helper.from_array(packed.scale_bytes, bytes_name)]
    return b


def q4k_embedding_nodes(scope: str, packed: PackedQ4K, v: int, h: int, scales_out: str, offsets_out: str) -> _Builder:
    """A Q4_K token embedding's scales and offsets [V, H/32, 1] (export/embedding.py's lookup multiplies and
    subtracts them as they are)."""
    from onnx import numpy_helper

    b, d_name, bytes_name, scale, offset = q4k_scale_nodes(scope, v, h)
    b.reshape(scale, [v, h // BLOCK, 1], scales_out)
    b.reshape(offset, [v, h // BLOCK, 1], offsets_out)
    b.initializers += [numpy_helper.from_array(packed.d_dmin, d_name),
                       numpy_helper.from_array(packed.scale_bytes, bytes_name)]
    return b


def q6k_8bit_nodes(scope: str, packed: PackedQ6K, n: int, k: int, codes_out: str, scales_out: str) -> _Builder:
    """A Q6_K tensor's 8-bit MatMulNBits codes [N, K/32, 32] uint8 and scales [N, K/32] float32: gguf's weights
    (d*sc) * (q - 32), then per block of 32 s = max|w| / 127, c = clip(round_half_even(w / s), -127, 127) + 128
    (s = 0: c = 128). The bit unpacking stays in uint8 (a quarter of int32's bytes for the folding's temporaries)."""
    from onnx import TensorProto, numpy_helper

    b = _Builder(scope)
    names = {part: b.scope + part for part in ("low", "high", "scales", "d")}
    low = names["low"]  # [N, K/2]: q & 15 of weights 2i (low nibble) and 2i + 1
    low = b.reshape(b.stack_last([b.u8_op("Mod", low, 16), b.u8_op("Div", low, 16)]), [n, k])
    high = names["high"]  # [N, K/4]: q >> 4 of weights 4i .. 4i + 3, two bits each, 4i lowest
    fields = [b.u8_op("Mod", high, 4), b.u8_op("Mod", b.u8_op("Div", high, 4), 4),
              b.u8_op("Mod", b.u8_op("Div", high, 16), 4), b.u8_op("Div", high, 64)]
    high = b.reshape(b.stack_last(fields), [n, k])
    q = b.op("Add", [low, b.u8_op("Mul", high, 16)])  # [N, K] uint8, 0..63
    q = b.op("Sub", [b.cast(q, TensorProto.FLOAT), b.const("offset", np.float32(32))])
    q = b.reshape(q, [n, k // 16, 16])
    d = b.reshape(b.cast(names["d"], TensorProto.FLOAT), [n, k // SUPER_BLOCK, 1])
    sc = b.reshape(b.cast(names["scales"], TensorProto.FLOAT), [n, k // SUPER_BLOCK, 16])
    ds = b.reshape(b.op("Mul", [d, sc]), [n, k // 16, 1])  # exact: fp16 * int8
    w = b.reshape(b.op("Mul", [ds, q]), [n, k // BLOCK, BLOCK])  # gguf's dequantization
    s = b.op("Div", [b.op("ReduceMax", [b.op("Abs", [w])], axes=[-1], keepdims=0),
                     b.const("max_code", np.float32(127))], scales_out)  # [N, K/32]
    zero = b.const("zero", np.float32(0))
    safe = b.op("Where", [b.op("Greater", [s, zero]), s, b.const("one", np.float32(1))])
    unit = b.op("Unsqueeze", [safe, b.const("last", np.array([-1], np.int64))])
    rounded = b.op("Round", [b.op("Div", [w, unit])])
    clipped = b.op("Clip", [rounded, b.const("low_code", np.float32(-127)), b.const("high_code", np.float32(127))])
    b.op("Cast", [b.op("Add", [clipped, b.const("center", np.float32(128))])], codes_out, to=TensorProto.UINT8)
    b.initializers += [numpy_helper.from_array(packed.low, names["low"]),
                       numpy_helper.from_array(packed.high, names["high"]),
                       numpy_helper.from_array(packed.scales, names["scales"]),
                       numpy_helper.from_array(packed.d, names["d"])]
    return b
