"""Searched int4/int8 scales and an 8-bit LM head (export/rounding.py): the same MatMulNBits layout as ONNX
Runtime's quantizer (symmetric, block 32), lower block error, and every mode still exact on the result."""
from __future__ import annotations

import numpy as np
import pytest

from mirrorsd.errors import ExportOptionError
from mirrorsd.export.gguf_blocks import dequantize_nbits
from mirrorsd.export.rounding import RoundingOptions, quantize_weight
from test_quantize import modes_agree


def block_errors(weight: np.ndarray, found, importance=None) -> np.ndarray:
    """Squared error per (column, block) of the dequantized weight, optionally weighted per input channel."""
    k, n = weight.shape
    err = (dequantize_nbits(found.packed, found.scales, found.bits) - weight.T) ** 2  # [N, K]
    if importance is not None:
        err = err * importance[None]
    return err.reshape(n, k // 32, 32).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_searched_scales_never_lose_to_absmax(bits):
    rng = np.random.default_rng(0)
    weight = (rng.standard_t(4, size=(128, 48)) * 0.02).astype(np.float32)  # heavy tails, as LLM weights have
    weight[:32, 0] = 0.0  # an all-zero block: scale 0, codes at the zero point
    importance = rng.gamma(0.5, size=128).astype(np.float32)
    absmax = quantize_weight(weight, bits, "absmax")
    mse = quantize_weight(weight, bits, "mse")
    data = quantize_weight(weight, bits, "data", importance)
    assert absmax.packed.shape == (48, 4, 32 * bits // 8) and absmax.scales.shape == (48, 4)
    assert (block_errors(weight, mse) <= block_errors(weight, absmax) * (1 + 1e-6)).all()
    assert block_errors(weight, mse).sum() < block_errors(weight, absmax).sum()
    assert (block_errors(weight, data, importance) <= block_errors(weight, mse, importance) * (1 + 1e-6)).all()
    assert np.all(dequantize_nbits(absmax.packed, absmax.scales, bits)[0, :32] == 0)


def test_bad_rounding_options_are_refused():
    with pytest.raises(ExportOptionError, match="not a search"):
        RoundingOptions("awq")
    with pytest.raises(ExportOptionError, match="--head-bits 6"):
        RoundingOptions("mse", 6)


@pytest.mark.parametrize("search, head_bits", [("mse", 8), ("data", None)])
def test_requantized_with_a_search_stays_exact_in_every_mode(exported, tmp_path, search, head_bits):
    import onnx
    from onnx import helper

    from mirrorsd.export.requantize import requantize
    from mirrorsd.manifest import load_manifest

    source = exported("llama", draft_layers=3)
    out = requantize(source, tmp_path / "q", "int4", "int4", scale_search=search, head_bits=head_bits)
    manifest = load_manifest(out)
    assert manifest.export_options["rounding"] == {"scale_search": search, "head_bits": head_bits}
    assert 0.0 <= manifest.graph("suffix").validation["target_quant_top1_agreement"] <= 1.0
    bits = {}
    for node in onnx.load(str(out / "suffix.onnx")).graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["block_size"] == 32 and len(node.input) == 3  # what devices/kernels take
            bits[attrs["N"] == manifest.target.vocab_size] = attrs["bits"]
    assert bits == {True: head_bits or 4, False: 4}
    modes_agree(out)


def test_requantize_records_the_real_text_agreement(exported, tmp_path):
    from mirrorsd.export.requantize import requantize
    from mirrorsd.manifest import load_manifest

    out = requantize(exported("llama", draft_layers=3), tmp_path / "q", "int8", None)
    validation = load_manifest(out).graph("suffix").validation
    assert 0.0 <= validation["target_quant_text_top1_agreement"] <= 1.0 and "target_quant_top1_agreement" in validation
