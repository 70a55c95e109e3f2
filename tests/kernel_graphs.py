"""Graphs of MatMulNBits layers for the kernel tests (weights quantized here in ONNX Runtime's layout), and sessions
that run them with mirrorsd's kernel library registered.

    B            uint8 [N, ceil(K/32), 32*bits/8]   4-bit: weight 2j in the low nibble of byte j, 2j+1 in the high one
    scales       float [N * ceil(K/32)]             symmetric: w = (q - 2^(bits-1)) * scale
    zero_points  float [N * ceil(K/32)] or absent   asymmetric: w = (q - zero_point) * scale
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32


@dataclass(frozen=True)
class Layer:
    B: np.ndarray  # uint8 [N, kb, blob]
    scales: np.ndarray  # float32 [N * kb]
    dequantized: np.ndarray  # float32 [K, N], what B and scales stand for
    bias: np.ndarray | None  # float32 [N]
    bits: int
    zero_points: np.ndarray | None = None  # float32 [N * kb], asymmetric layers only

    @property
    def K(self) -> int:
        return self.dequantized.shape[0]

    @property
    def N(self) -> int:
        return self.dequantized.shape[1]


def quantize(w: np.ndarray, bits: int, bias: np.ndarray | None = None) -> Layer:
    """Round-to-nearest symmetric quantization of w [K, N] per block of 32 along K (K padded with zeros)."""
    K, N = w.shape
    kb = -(-K // BLOCK)
    padded = np.zeros((kb * BLOCK, N), np.float32)
    padded[:K] = w
    blocks = padded.T.reshape(N, kb, BLOCK)  # [N, kb, 32]
    top = 2 ** (bits - 1)
    scales = (np.abs(blocks).max(axis=2) / (top - 1)).astype(np.float32)  # [N, kb]
    safe = np.where(scales > 0, scales, 1.0)[..., None]
    q = np.clip(np.rint(blocks / safe), -top, top - 1).astype(np.int32) + top  # unsigned
    dequantized = ((q - top) * scales[..., None]).astype(np.float32).reshape(N, kb * BLOCK).T[:K]
    if bits == 4:
        B = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:
        B = q.astype(np.uint8)
    return Layer(B, scales.reshape(-1), np.ascontiguousarray(dequantized), bias, bits)


def quantize_asymmetric(w: np.ndarray, bits: int, bias: np.ndarray | None = None) -> Layer:
    """Min-max quantization of w [K, N] per block of 32 along K with a float zero point per block, as a GGUF K-quant
    block maps onto MatMulNBits: codes 0..2^bits-1, scale (max - min) / (2^bits - 1), zero point -min / scale
    (a float, not rounded to a code). Blocks of one value get scale 0 and zero point 0."""
    K, N = w.shape
    kb = -(-K // BLOCK)
    padded = np.zeros((kb * BLOCK, N), np.float32)
    padded[:K] = w
    blocks = padded.T.reshape(N, kb, BLOCK)  # [N, kb, 32]
    low, high = blocks.min(axis=2), blocks.max(axis=2)
    scales = ((high - low) / (2**bits - 1)).astype(np.float32)  # [N, kb]
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    zero_points = np.where(scales > 0, -low / safe, 0.0).astype(np.float32)
    q = np.clip(np.rint(blocks / safe[..., None] + zero_points[..., None]), 0, 2**bits - 1).astype(np.int32)
    exact = (q - zero_points[..., None].astype(np.float64)) * scales[..., None]  # (c - zp) * s, not rounded
    dequantized = exact.astype(np.float32).reshape(N, kb * BLOCK).T[:K]
    B = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8) if bits == 4 else q.astype(np.uint8)
    return Layer(B, scales.reshape(-1), np.ascontiguousarray(dequantized), bias, bits, zero_points.reshape(-1))


def quantize_q4k(w: np.ndarray, bias: np.ndarray | None = None, constant_blocks: int = 0,
                 largest: int = 63) -> Layer:
    """w [K, N] (K a multiple of 256) as a GGUF Q4_K tensor carried into MatMulNBits (export/gguf_blocks.py): per
    column and super-block of 256 weights an fp16 d and dmin, per block of 32 a 6-bit sc and m (the super-block's
    largest sc and m equal to ``largest``: 63 as GGUF's quantizer makes them), scale d * sc, offset dmin * m, codes
    round((w + offset) / scale), zero point offset / scale. ``constant_blocks``: the first that many blocks get sc = 0
    (all-constant blocks: codes 0, scale = offset, zero point 1)."""
    from mirrorsd.export.gguf_blocks import pack, with_zero_points

    K, N = w.shape
    kb = K // BLOCK
    blocks = w.T.reshape(N, kb, BLOCK).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0.0)
    spans = (blocks.max(axis=2) - low) / 15  # [N, kb]
    d = (spans.reshape(N, kb // 8, 8).max(axis=2) / largest).astype(np.float16).astype(np.float32)
    dmin = ((-low).reshape(N, kb // 8, 8).max(axis=2) / largest).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(spans.reshape(N, kb // 8, 8) / np.where(d > 0, d, 1)[..., None]), 0, largest)
    m = np.clip(np.rint((-low).reshape(N, kb // 8, 8) / np.where(dmin > 0, dmin, 1)[..., None]), 0, largest)
    sc.reshape(-1)[:constant_blocks] = 0
    scales = (d[..., None] * sc.astype(np.float32)).reshape(N, kb)
    offsets = (dmin[..., None] * m.astype(np.float32)).reshape(N, kb)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    codes = np.clip(np.rint((blocks + offsets[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    codes, scales, zero_points = with_zero_points(codes, scales, offsets)
    exact = (codes - zero_points[..., None].astype(np.float64)) * scales[..., None]
    dequantized = exact.astype(np.float32).reshape(N, K).T
    return Layer(pack(codes, 4), scales.reshape(-1), np.ascontiguousarray(dequantized), bias, 4,
                 zero_points.reshape(-1))


def random_layers(rng: np.random.Generator, dims: list[int], bits: int, bias: bool = False,
                  zero_points: bool = False) -> list[Layer]:
    """Layers dims[0] -> dims[1] -> ... with weights ~ N(0, 1/K); with float zero points when ``zero_points``."""
    layers = []
    for K, N in zip(dims[:-1], dims[1:]):
        w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
        b = rng.standard_normal(N).astype(np.float32) * 0.1 if bias else None
        layers.append((quantize_asymmetric if zero_points else quantize)(w, bits, b))
    return layers


def model_bytes(layers: list[Layer], domain: str, accuracy_level: int = 4, extra_attributes: dict | None = None,
                opset_domain: bool = True, **tweaks) -> bytes:
    """A graph A -> MatMulNBits -> ... -> Y over ``layers``, its MatMulNBits nodes in ``domain``.

    A layer with float zero points passes them as input 3. tweaks: B_as_input (B a graph input, not an initializer),
    zero_points (True: packed uint8 zero points 0x88 as input 3; an array: that array) / g_idx (add those inputs),
    free_k (A's last dimension symbolic, so that a wrong one reaches the kernel)."""
    from onnx import TensorProto, helper, numpy_helper

    k_dim = "K" if tweaks.get("free_k") else layers[0].K
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k_dim])]
    x = "A"
    for i, layer in enumerate(layers):
        names = [x, f"B{i}", f"S{i}"]
        if tweaks.get("B_as_input"):
            inputs.append(helper.make_tensor_value_info(f"B{i}", TensorProto.UINT8, list(layer.B.shape)))
        else:
            inits.append(numpy_helper.from_array(layer.B, f"B{i}"))
        inits.append(numpy_helper.from_array(layer.scales, f"S{i}"))
        optional = {3: "zero_points", 4: "g_idx", 5: "bias"}
        packed_zero_points = np.full(layer.N * -(-layer.K // 32), 0x88, np.uint8)
        given = tweaks.get("zero_points")
        values = {"zero_points": given if isinstance(given, np.ndarray) else
                  packed_zero_points if given else layer.zero_points,
                  "g_idx": np.arange(layer.K, dtype=np.int32) // 32 if tweaks.get("g_idx") else None,
                  "bias": layer.bias}
        for index, kind in optional.items():
            if values[kind] is not None:
                names += [""] * (index - len(names)) + [f"{kind}{i}"]
                inits.append(numpy_helper.from_array(values[kind], f"{kind}{i}"))
        attributes = dict(K=layer.K, N=layer.N, bits=layer.bits, block_size=BLOCK, accuracy_level=accuracy_level)
        attributes.update(extra_attributes or {})
        attributes = {k: v for k, v in attributes.items() if v is not None}
        nodes.append(helper.make_node("MatMulNBits", names, [f"Y{i}"], domain=domain, name=f"mm{i}", **attributes))
        x = f"Y{i}"
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", layers[-1].N])], inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if opset_domain else [])
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def reference(layers: list[Layer], a: np.ndarray) -> np.ndarray:
    """The float64 product through the dequantized weights (no activation quantization)."""
    x = a.astype(np.float64)
    for layer in layers:
        x = x @ layer.dequantized.astype(np.float64) + (layer.bias if layer.bias is not None else 0.0)
    return x


def activation_error_bound(layer: Layer, a: np.ndarray) -> np.ndarray:
    """Bound on |kernel(a) - a @ dequantized| for one layer, derived from the kernel's numerics [M, N].

    Each activation is rounded to the nearest step of its block (step s_b = max|a_b| / 127), so it moves by at
    most s_b / 2: the product moves by at most sum_b s_b / 2 * sum_{k in b} |w_kn|. The float steps (one rounding
    of w_scale * a_scale, one fma per block, the bias add) add at most (kb + 3) * 2^-24 times the sum of the
    magnitudes involved, sum_b |w_scale a_scale d_b| + |bias| <= sum_k |a_k w_kn| + (rounding bound) + |bias|.

    With float zero points each block adds two terms that may cancel, w_scale a_scale d_b and u_b a_scale qsum_b
    (u_b = (center - zp) w_scale, rounded twice when packed): each is at most (sum_{k in b} |a_k| + 16 s_b) *
    (2^(bits-1) w_scale + |u_b|) in magnitude (|q_k| a_scale <= |a_k| + s_b / 2), and the six roundings per block
    (u's two, two products, two fma) add at most (6 kb + 3) * 2^-24 times their sum plus the bias and the rounding
    bound; the float32 rounding of the reference's own weights adds 2^-24 sum_k |a_k w_kn|."""
    K, N = layer.dequantized.shape
    kb = -(-K // BLOCK)
    padded = np.zeros((a.shape[0], kb * BLOCK))
    padded[:, :K] = a
    blocks = np.abs(padded.reshape(a.shape[0], kb, BLOCK))  # [M, kb, 32]
    steps = blocks.max(axis=2) / 127.0  # [M, kb]
    w = np.zeros((kb * BLOCK, N))
    w[:K] = np.abs(layer.dequantized)
    column_mass = w.reshape(kb, BLOCK, N).sum(axis=1)  # [kb, N]
    rounding = steps / 2 @ column_mass
    bias = np.abs(layer.bias) if layer.bias is not None else 0.0
    product_mass = np.abs(a) @ np.abs(layer.dequantized.astype(np.float64))
    if layer.zero_points is None:
        return rounding + (kb + 3) * 2.0**-24 * (product_mass + rounding + bias)
    scales = layer.scales.reshape(N, kb).T.astype(np.float64)  # [kb, N]
    center = 2 ** (layer.bits - 1)
    offsets = np.abs(center - layer.zero_points.reshape(N, kb).T.astype(np.float64)) * scales
    activation_mass = blocks.sum(axis=2) + 16 * steps  # [M, kb]
    term_mass = activation_mass @ (center * scales + offsets)  # [M, N]
    return rounding + (6 * kb + 3) * 2.0**-24 * (term_mass + rounding + bias) + 2.0**-24 * product_mass


def library_or_skip():
    """The built kernel library; skips only when the machine has no C++ compiler to build it."""
    from mirrorsd.errors import KernelsUnavailableError
    from mirrorsd.devices import kernels
    from mirrorsd.devices.kernels.build import find_compiler

    try:
        return kernels.library()
    except KernelsUnavailableError:
        if find_compiler() is None:
            import pytest

            pytest.skip("no C++ compiler on this machine: the kernels cannot be built (the only allowed skip)")
        raise


def open_session(model, monkeypatch, threads: int = 1, replace: bool = False, isa: str | None = None,
                 config: dict | None = None, superblocks: bool = True):
    """An ONNX Runtime session on ``model`` (bytes or path) with the kernels registered, ``isa`` forcing a path;
    ``superblocks`` False keeps every node in its path's usual layout (MIRRORSD_KERNELS_SUPERBLOCKS=0)."""
    import onnxruntime as ort

    from mirrorsd.devices import kernels

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    kernels.register(opts, replace=replace, allow_slow=True)
    with monkeypatch.context() as patch:
        if isa:
            patch.setenv(kernels.ISA_ENV, isa)  # read by the library when the session creates its kernels
        patch.setenv("MIRRORSD_KERNELS_SUPERBLOCKS", "1" if superblocks else "0")
        return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def run(session, a: np.ndarray) -> np.ndarray:
    return session.run(None, {"A": a})[0]
