"""Is ONNX Runtime's own MatMulNBits kernel row-invariant on this CPU? Measured once per process, in milliseconds.

A target quantized with int8 activations (accuracy level 4, what a grouped-attention export gets) is only exact under
sd/mirror if each row of a verification window gets bitwise the logits that decoding it alone gets. mirrorsd's
kernels (devices/kernels) are built that way on every path. ONNX Runtime's are measured: on AVX-512 VNNI CPUs (an
AMD Zen 4, an Intel Xeon) its one-row and several-row paths agreed bit for bit; on an AVX2-only AMD EPYC they did not
(a Qwen-shaped tiny target drifted visibly between a window and one-row decoding, and sd left ar's tokens;
docs/platform-notes.md, ONNX Runtime).

The check builds a one-node MatMulNBits graph by hand (no onnx package: the runtime does not need it), feeds the
same random rows once as a batch and once one by one, and compares the bits, for 4- and 8-bit weights, with one
thread and with every core. A target whose manifest counts weights with float zero points (carried GGUF Q4_K blocks,
names.FLOAT_ZERO_POINT_WEIGHTS) is also checked with 4-bit float zero points: ONNX Runtime runs those through another
path (the weights dequantized to float, then a float GEMM), which was not row-invariant on a CPU where the int8 path
is (docs/platform-notes.md).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from mirrorsd.names import FLOAT_ZERO_POINT_WEIGHTS
from mirrorsd.onnx_wire import message_field as _msg
from mirrorsd.onnx_wire import varint_field as _varint

INT8_ACTIVATIONS = 4  # MatMulNBits accuracy level whose exactness depends on the kernel
BLOCK = 32
K, N, ROWS = 512, 192, 5  # several 16-column groups and K blocks: the tiled paths, not a corner case
FLOAT, UINT8, INT_ATTRIBUTE = 1, 2, 2  # TensorProto.DataType, AttributeProto.AttributeType


def _tensor(name: str, dims: tuple[int, ...], data_type: int, raw: bytes) -> bytes:
    out = b"".join(_varint(1, d) for d in dims) + _varint(2, data_type) + _msg(8, name.encode())
    return out + _msg(9, raw)


def _value_info(name: str, last_dim: int) -> bytes:
    dims = _msg(1, _msg(2, b"rows")) + _msg(1, _varint(1, last_dim))  # [rows, last_dim], rows symbolic
    return _msg(1, name.encode()) + _msg(2, _msg(1, _varint(1, FLOAT) + _msg(2, dims)))


def _int_attribute(name: str, value: int) -> bytes:
    return _msg(1, name.encode()) + _varint(3, value) + _varint(20, INT_ATTRIBUTE)


def matmul_nbits_model(bits: int, seed: int = 0, zero_points: bool = False) -> bytes:
    """Y[rows, N] = A[rows, K] @ dequantized B, weights in blocks of 32 (symmetric, or with float zero points),
    int8 activations."""
    rng = np.random.default_rng(seed)
    blocks, blob = K // BLOCK, BLOCK * bits // 8
    weights = rng.integers(0, 256, (N, blocks, blob), dtype=np.uint8)  # any bytes are valid codes
    scales = (rng.random(N * blocks, dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    attributes = b"".join(_msg(5, _int_attribute(k, v)) for k, v in (
        ("K", K), ("N", N), ("bits", bits), ("block_size", BLOCK), ("accuracy_level", INT8_ACTIVATIONS)))
    inputs = [b"A", b"B", b"scales"] + ([b"zero_points"] if zero_points else [])
    node = (b"".join(_msg(1, name) for name in inputs) + _msg(2, b"Y") + _msg(3, b"mm")
            + _msg(4, b"MatMulNBits") + _msg(7, b"com.microsoft") + attributes)
    offsets = (rng.random(N * blocks, dtype=np.float32) * (1 << bits)).astype(np.float32)
    graph = (_msg(1, node) + _msg(2, b"row_check")
             + _msg(5, _tensor("B", (N, blocks, blob), UINT8, weights.tobytes()))
             + _msg(5, _tensor("scales", (N * blocks,), FLOAT, scales.tobytes()))
             + (_msg(5, _tensor("zero_points", (N * blocks,), FLOAT, offsets.tobytes())) if zero_points else b"")
             + _msg(11, _value_info("A", K)) + _msg(12, _value_info("Y", N)))
    opsets = _msg(8, _msg(1, b"") + _varint(2, 17)) + _msg(8, _msg(1, b"com.microsoft") + _varint(2, 1))
    return _varint(1, 8) + _msg(7, graph) + opsets


def window_vs_rows(bits: int, threads: int, zero_points: bool = False) -> float:
    """Max |difference| between ROWS rows computed together and the same rows one at a time (0.0: invariant)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    session = ort.InferenceSession(matmul_nbits_model(bits, zero_points=zero_points), opts,
                                   providers=["CPUExecutionProvider"])
    a = np.random.default_rng(bits).standard_normal((ROWS, K)).astype(np.float32)
    together = session.run(None, {"A": a})[0]
    alone = np.concatenate([session.run(None, {"A": a[i:i + 1]})[0] for i in range(ROWS)])
    return float(np.abs(together - alone).max())


@functools.lru_cache(maxsize=1)
def ort_int8_kernel_difference() -> float:
    """The largest window-vs-row difference of ONNX Runtime's int8-activation MatMulNBits here (0.0: exact)."""
    cores = max(1, os.cpu_count() or 1)
    return max(window_vs_rows(bits, threads) for bits in (4, 8) for threads in sorted({1, cores}))


@functools.lru_cache(maxsize=1)
def ort_float_zero_point_difference() -> float:
    """The same for 4-bit weights with float zero points (ONNX Runtime refuses 8-bit ones)."""
    cores = max(1, os.cpu_count() or 1)
    return max(window_vs_rows(4, threads, zero_points=True) for threads in sorted({1, cores}))


def target_kernel_difference(manifest) -> tuple[float, str]:
    """The window-vs-row difference of ONNX Runtime's MatMulNBits for the weights of ``manifest``'s target, and
    which of its paths that is ("int8 activations", or "float zero points" as well)."""
    if any(graph.model == "target" and graph.validation.get(FLOAT_ZERO_POINT_WEIGHTS, 0)
           for graph in manifest.graphs.values()):
        return (max(ort_int8_kernel_difference(), ort_float_zero_point_difference()),
                "int8 activations and weights with float zero points")
    return ort_int8_kernel_difference(), "int8 activations"


def inexact_windows(manifest, placements: dict) -> str:
    """Why a verification window's rows would not be bitwise the rows ar decodes, or "" (the usual case): only a
    target with int8 activations (a quantized grouped-attention export) run by ONNX Runtime's own CPU kernel on
    a CPU where that kernel's one-row path differs from its several-row path. ``placements``: graph role ->
    devices.placement.Placement of a loaded pipeline."""
    precision = manifest.export_options.get("target_precision")
    if manifest.attention != "grouped" or precision not in ("int4", "int8"):
        return ""
    ort_kernel = [p for role, p in placements.items() if p.model == "target" and p.backend == "onnxruntime"
                  and "CPU" in p.effective and p.kernels != "mirrorsd"]
    if not ort_kernel:
        return ""
    difference, paths = target_kernel_difference(manifest)
    if difference == 0.0:
        return ""
    return (f"the {precision} target runs ONNX Runtime's MatMulNBits kernel with {paths}, whose one-row "
            f"path differs from its several-row path on this CPU (by {difference:.1e} per layer, measured "
            f"at load), so verification windows drift from one-row decoding")
