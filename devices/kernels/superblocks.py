"""Which MatMulNBits nodes mirrorsd's kernel packs in its super-block layout, and the bytes a step then reads less.

A carried GGUF Q4_K tensor (export/gguf_blocks.py) keeps per column and block of 32 a float scale and a float zero
point; the kernel's interleaved layout streams them as two floats beside the block's 16 bytes of codes (24 bytes).
Where they have Q4_K's form (scale = d * sc, zero point = dmin * m / scale, exactly), the AVX-512 and AVX2 paths
pack them per super-block of 8 blocks instead (src/superblocks.cpp): 18 bytes per block plus 8 per super-block,
with the same numbers. The library decides that when a session packs the node; ``has_superblock_form`` asks it the
same question for arrays read from a graph (the bandwidth ceiling counts the bytes a step really reads).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from mirrorsd.devices.kernels.build import KernelLibrary

ENV = "MIRRORSD_KERNELS_SUPERBLOCKS"  # "0": every node in its path's interleaved layout (A/B measurements)
PATHS = ("avx512vnni", "avx2")  # the paths with a super-block layout
BLOCK, BLOCKS_PER_SUPER = 32, 8
SAVED_PER_BLOCK = 5  # bytes per column and block: 16 + 4 + 4 -> 16 + 1 + 1 + 8 / 8


def in_use(library: KernelLibrary) -> bool:
    """Sessions created now pack Q4_K-form nodes in super-blocks: the path they run has the layout and ENV is not
    "0" (the path: MIRRORSD_KERNELS_ISA if set, else the library's pick)."""
    path = os.environ.get("MIRRORSD_KERNELS_ISA") or library.fast_path
    return path in PATHS and os.environ.get(ENV) != "0"


def has_superblock_form(library: KernelLibrary, k: int, n: int, scales: np.ndarray, zero_points: np.ndarray) -> bool:
    """Whether the library packs a 4-bit node of shape K x N with these float scales and zero points [N * kb] in
    super-blocks (its own test, src/superblocks.cpp: find_superblocks)."""
    kb = -(-k // BLOCK)
    scales = np.ascontiguousarray(scales, np.float32).reshape(-1)
    zero_points = np.ascontiguousarray(zero_points, np.float32).reshape(-1)
    if scales.size != n * kb or zero_points.size != n * kb:
        return False
    handle = ctypes.CDLL(str(library.path))
    function = handle.mirrorsd_kern_superblock_form
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return bool(function(k, n, scales.ctypes.data, zero_points.ctypes.data))


def bytes_saved(buf, folder: Path, library: KernelLibrary) -> int:
    """Bytes per forward that the super-block layout saves on the serialized model ``buf`` (external data in
    ``folder``): SAVED_PER_BLOCK per column and block of every 4-bit MatMulNBits node with float zero points and
    Q4_K's form. Read without the onnx package (devices/unpack.py's wire reader): the runtime installs without it."""
    from mirrorsd.devices.unpack import graph_contents, read_initializer

    nodes, initializers = graph_contents(buf)
    saved = 0
    for node in nodes.values():
        if node.op_type != "MatMulNBits" or len(node.inputs) < 4 or not node.inputs[3]:
            continue
        k, n = node.attributes.get("K", 0), node.attributes.get("N", 0)
        if node.attributes.get("bits") != 4 or node.attributes.get("block_size") != BLOCK:
            continue
        if node.inputs[2] not in initializers or node.inputs[3] not in initializers:
            continue
        scales, zero_points = (read_initializer(buf, initializers[name], folder) for name in node.inputs[2:4])
        if zero_points.dtype == np.float32 and has_superblock_form(library, k, n, scales, zero_points):
            saved += SAVED_PER_BLOCK * n * -(-k // BLOCK)
    return saved
