"""int4 layouts that `mirrorsd quantize` does not offer, for the quality command to score: symmetric or asymmetric
(uint8 zero points) weights in blocks of 32, 64 or 128, each a copy of an fp32 export quantized by ONNX Runtime's
round-to-nearest exactly as `mirrorsd quantize --target-precision int4` does, with only the block size and the
symmetry changed. mirrorsd's kernel refuses those layouts (any block but 32, uint8 zero points), so score them on
ONNX Runtime's own MatMulNBits kernel (`--kernels ort`): these copies are for quality and size, not speed.

    python scripts/lab/quant_layouts.py FP32_EXPORT OUT_PARENT [sym32,asym32,sym64,asym64,sym128,asym128]
    mirrorsd eval --kernels ort --reference FP32_EXPORT --model OUT_PARENT/sym32 --model OUT_PARENT/asym32 ...
"""
from __future__ import annotations

import sys
from pathlib import Path

from onnxruntime.quantization import matmul_nbits_quantizer

from mirrorsd.export import quantize
from mirrorsd.export.requantize import requantize

_ORIGINAL = matmul_nbits_quantizer.MatMulNBitsQuantizer


def layout(name: str) -> tuple[bool, int]:
    symmetric = name.startswith("sym")
    return symmetric, int(name.removeprefix("sym" if symmetric else "asym"))


def main(source: Path, parent: Path, variants: list[str]) -> None:
    for name in variants:
        symmetric, block = layout(name)

        class Quantizer(_ORIGINAL):  # the one call in quantize_model, with this variant's block and symmetry
            def __init__(self, model, **kwargs):
                super().__init__(model, **{**kwargs, "block_size": block, "is_symmetric": symmetric})

        matmul_nbits_quantizer.MatMulNBitsQuantizer = Quantizer
        quantize.BLOCK = block
        output = requantize(source, parent / name, target_precision="int4", progress=print)
        size = sum(f.stat().st_size for f in output.iterdir() if f.name.startswith(("prefix", "suffix")))
        print(f"{name}: {output} (target graphs {size / 1e6:.1f} MB)", flush=True)
    matmul_nbits_quantizer.MatMulNBitsQuantizer = _ORIGINAL


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]),
         (sys.argv[3] if len(sys.argv) > 3 else "sym32,asym32,sym64,asym64,sym128,asym128").split(","))
