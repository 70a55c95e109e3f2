"""GGUF's Q6_K blocks read as codes and scales (numpy only): shared by the token embedding (export/embedding.py) and
packed storage (export/packed_weights.py)."""
from __future__ import annotations

import numpy as np


def q6_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks [V, nb, 210] -> codes q as stored (0..63) [V, nb*256] uint8 and scales d*sc_j per
    sub-block of 16 [V, nb*16] float32 (exact: an fp16 times an int8), so that gguf's weight is scale * (q - 32).

    A block: 128 bytes of low nibbles | 64 bytes of 2-bit highs | 16 int8 sub-block scales | d fp16. Within each
    half of 128 weights, low nibble byte i holds weight i (low) and i + 64 (high), for i < 64; high byte i holds
    the top 2 bits of weights i, i + 32, i + 64, i + 96 (bits 0-1, 2-3, 4-5, 6-7)."""
    v, nb, _ = blocks.shape
    low, high = blocks[..., 0:128], blocks[..., 128:192]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [V, nb, 16]
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)  # [V, nb]
    low = low.reshape(v, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(v, nb, 2, 128)  # per half: weights 0..63 then 64..127
    high = high.reshape(v, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 0x03).reshape(v, nb, 2, 128)  # per half: weights 0..31, 32..63, 64..95, 96..127
    codes = (low | (high << 4)).astype(np.uint8).reshape(v, nb * 256)
    return codes, (d[..., None] * sc).reshape(v, nb * 16)
