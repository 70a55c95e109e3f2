"""Weight-only quantization of exported graphs: the settings and the one step that applies them.

    fp32   as traced (the CPU default)
    fp16   traced in half precision, float32 at the graph's inputs and outputs (GPU targets; not a CPU speed-up)
    int8   ONNX Runtime MatMulNBits: 8-bit weights in blocks of 32, symmetric
    int4   ONNX Runtime MatMulNBits: 4-bit weights in blocks of 32, symmetric
A layer-streamed export quantizes each layer as it is written (assembly.py), ``mirrorsd quantize`` a finished fp32
folder (requantize.py); both call ``quantize_model`` with these settings, and give the same bits.
Activations are quantized to int8 per block within a row (accuracy level 4: ONNX Runtime's fast integer kernels),
except in a *target* whose graphs use transformers' eager attention (folders exported before grouped attention,
``Manifest.attention == "eager"``): those keep fp32 activations (level 1). Why: greedy losslessness needs a row's
logits to be the same whether the target runs it alone (``ar``) or inside a verification window (``sd``/``mirror``).
MatMulNBits at level 4 computes each row bitwise the same whatever the number of rows, but eager attention does not
(ONNX Runtime's one-row and many-row float kernels sum in different orders), and every int8 re-quantization downstream
turned those rounding differences into whole quantization steps: 0.28 logits on the Qwen target, and sd/mirror
differed from ar on 2 of 12 prompts (docs/bench/rejected-int8-activation-target). Grouped attention
(export/graphs/attention.py) keeps every row bitwise invariant, so its targets take the fast path exactly
(scripts/lab/window_invariance.py, tests/test_batch_invariance.py). A draft's numerics never change the output.

Not ``quantize_dynamic``: it scales activations per *tensor*, so a row's result depends on the other rows of the
batch; a verification window (gamma + 1 rows) would then not reproduce single-row decoding and SD would stop being
lossless (tests/test_quantize.py caught exactly that). MatMulNBits quantizes activations per block *within a row*.
The token embedding (a Gather) becomes 8-bit blocks or the GGUF's own blocks (export/embedding.py; ``--embedding
float`` keeps it fp32). A tied LM head is a MatMul on its own constant-folded initializer in these
TorchScript-traced graphs, so it is quantized like every other MatMul.
Greedy losslessness is relative to the *exported target graphs*: with an int8/int4 target, every decoder emits
exactly what target-only decoding on those quantized graphs emits, not what the fp32 model would.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from mirrorsd.errors import ExportOptionError
from mirrorsd.names import PRECISIONS, WEIGHT_BITS

QUANTIZED = ("int8", "int4")  # what quantize_model does; fp16 graphs are traced in fp16 (templates.py)
BITS = WEIGHT_BITS
BLOCK = 32  # quantization block along K: accurate and fast for these models (docs/platform-notes.md, ONNX Runtime)
PROTOBUF_LIMIT = 2 * 1024**3 - 64 * 1024**2


def check_precision(value: str, flag: str, allowed: tuple[str, ...] = PRECISIONS) -> str:
    if value not in allowed:
        raise ExportOptionError(f"{flag} {value!r} is not a precision here", f"choose one of {', '.join(allowed)}",
                                f"for example {flag} int8")
    return value


FP32_ACTIVATIONS, INT8_ACTIVATIONS = 1, 4  # MatMulNBits accuracy levels


def accuracy_level(model: str, attention: str) -> int:
    """int8 activations, except for a target whose attention is not batch-invariant (see the module docstring)."""
    return INT8_ACTIVATIONS if model == "draft" or attention == "grouped" else FP32_ACTIVATIONS


def quantize_model(model, precision: str, kind: str = "target", attention: str = "eager", blocks=None,
                   role: str = "", rounding=None, embedding=None):
    """The one quantization step, for whole graphs and for the pieces of a layer-streamed export alike: every
    MatMul whose weight is an initializer becomes MatMulNBits (``attention``: the folder's ``Manifest.attention``). Each MatMul's result depends on its weight and the
    settings above only, so quantizing a graph piece by piece equals quantizing it whole.
    ``blocks``: a gguf_blocks.BlockPlan whose carried GGUF blocks replace quantizing the weights it maps exactly
    (same bits and block; float zero points for Q4_K), counted under graph ``role``. ``rounding``: a
    rounding.RoundingOptions that replaces ONNX Runtime's round-to-nearest by a scale search and/or an 8-bit LM
    head (same layout). ``embedding``: an embedding.EmbeddingPlan for the token embedding's Gather (None: a
    plan of mode "quantized" over ``blocks``)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    from mirrorsd.export.embedding import EmbeddingPlan, replace_embeddings

    fold_weight_identities(model.graph)
    replace_embeddings(model, embedding or EmbeddingPlan("quantized", blocks), role)
    if blocks is not None:
        from mirrorsd.export.gguf_blocks import replace_matmuls

        replace_matmuls(model, blocks, role, accuracy_level(kind, attention))
    if rounding is not None and rounding.active:
        from mirrorsd.export.rounding import round_matmuls

        round_matmuls(model, rounding, BITS[precision], accuracy_level(kind, attention))
    quantizer = MatMulNBitsQuantizer(model, bits=BITS[precision], block_size=BLOCK, is_symmetric=True,
                                    accuracy_level=accuracy_level(kind, attention))
    quantizer.process()
    return quantizer.model.model


def quantize_graph(path: Path, precision: str, source: Path | None = None, model: str = "target",
                   attention: str = "eager", rounding=None, embedding=None) -> None:
    """Write a quantized ``path`` (plus ``path.data`` when large) from ``source`` (default: ``path`` itself).

    ``attention`` is the folder's ``Manifest.attention``. Old files at ``path`` are unlinked, never written through.
    fp32 leaves everything untouched.
    """
    if precision == "fp32":
        return
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".quant-{path.stem}-") as scratch:
        _nbits(source or path, Path(scratch) / path.name, precision, model, attention, rounding, embedding)
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        for new in Path(scratch).iterdir():
            shutil.move(str(new), str(path.parent / new.name))


def _nbits(src: Path, dst: Path, precision: str, kind: str, attention: str, rounding=None,
           embedding=None) -> None:
    import onnx

    result = quantize_model(onnx.load(str(src), load_external_data=True), precision, kind, attention,
                            role=dst.stem, rounding=rounding, embedding=embedding)
    large = result.ByteSize() >= PROTOBUF_LIMIT
    onnx.save_model(result, str(dst), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=dst.name + ".data" if large else None, size_threshold=1024)


def fold_weight_identities(graph) -> int:
    """Point the consumers of ``Identity(initializer)`` at the initializer itself; returns how many were folded.

    TorchScript emits such an Identity when one weight feeds two MatMuls (the streaming draft's main head and stream
    head share the LM head). The quantizer only quantizes a MatMul whose weight *is* an initializer, so without
    this the stream head stayed fp32, the largest weight of a streaming draft, read on every forward."""
    initializers = {i.name for i in graph.initializer}
    kept_outputs = {o.name for o in graph.output}
    alias = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Identity" and n.input[0] in initializers and n.output[0] not in kept_outputs}
    if not alias:
        return 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
    identities = [n for n in graph.node if n.op_type == "Identity" and n.output[0] in alias]
    for node in identities:
        graph.node.remove(node)
    return len(identities)
