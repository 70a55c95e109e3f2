"""How far mirrorsd's MatMulNBits kernel is from the fp32 product, beside ONNX Runtime's kernels, on random data.

    python scripts/lab/kernel_accuracy.py [--k 1536 --n 1536 --rows 8] [--bits 4]

Quantizes W ~ N(0, 0.03^2) [K, N] with ONNX Runtime's MatMulNBitsQuantizer (symmetric, block 32) and runs
A ~ N(0, 1) [rows, K] through ONNX Runtime at accuracy levels 4 and 1 and through mirrorsd's kernel; prints max |diff|
against A @ W (fp32 weights) and against A @ dequantized W (what every kernel approximates), and between the kernels.
Needs onnx.
"""
from __future__ import annotations

import argparse

import numpy as np

from mirrorsd.devices import kernels


def quantized_model(w: np.ndarray, bits: int, level: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", w.shape[0]])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", w.shape[1]])],
                              [numpy_helper.from_array(w, "W")])
    quantizer = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     bits=bits, block_size=32, is_symmetric=True, accuracy_level=level)
    quantizer.process()  # edits the model it was given: a fresh one per call
    return quantizer.model.model.SerializeToString()


def dequantized(model: bytes, bits: int, K: int, N: int) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    tensors = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(model).graph.initializer}
    q = next(v for v in tensors.values() if v.dtype == np.uint8).reshape(N, -1).astype(np.int32)
    scales = next(v for v in tensors.values() if v.dtype == np.float32).reshape(N, -1)
    if bits == 4:
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(N, -1)
    values = (q - 2 ** (bits - 1)).reshape(N, scales.shape[1], 32) * scales[..., None]
    return values.reshape(N, -1)[:, :K].T.astype(np.float64)


def run(model: bytes, a: np.ndarray, ours: bool) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if ours:
        kernels.register(opts, replace=True)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run(None, {"A": a})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((args.k, args.n)) * 0.03).astype(np.float32)
    a = rng.standard_normal((args.rows, args.k)).astype(np.float32)
    level4, level1 = quantized_model(w, args.bits, 4), quantized_model(w, args.bits, 1)
    outputs = {"ort-level4": run(level4, a, False), "ort-level1": run(level1, a, False),
               "mirrorsd": run(level4, a, True)}
    exact, through_q = a.astype(np.float64) @ w, a.astype(np.float64) @ dequantized(level4, args.bits, args.k, args.n)
    print(f"int{args.bits}, K={args.k}, N={args.n}, {args.rows} rows; max |A @ W| = {np.abs(exact).max():.3f}")
    print("| kernel | max abs diff vs A @ W (fp32) | vs A @ dequantized W | vs ort-level4 |")
    print("|---|---|---|---|")
    for name, y in outputs.items():
        print(f"| {name} | {np.abs(y - exact).max():.3g} | {np.abs(y - through_q).max():.3g} | "
              f"{np.abs(y - outputs['ort-level4']).max():.3g} |")


if __name__ == "__main__":
    main()
