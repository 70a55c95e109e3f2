"""Every tensor name, file stem and dimension name of an export folder, defined once.

The exporter writes these names into the manifest; the runtime reads them back from the manifest, never from here.
"""
from __future__ import annotations

# Graph inputs and outputs (the ecosystem's names: optimum, onnxruntime-genai).
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
HIDDEN_STATES = "hidden_states"
LOGITS = "logits"
TOPK_IDS = "topk_ids"
TOPK_LOGPROBS = "topk_logprobs"
CANDIDATE_IDS = "candidate_ids"  # sparse exit head: [batch, sequence, m] token ids to score
CANDIDATE_LOGITS = "candidate_logits"  # sparse exit head: [batch, sequence, m] their logits
STREAM_LOGITS = "stream_logits"  # streaming draft: [batch, n, vocab], stream j predicts the token j+1 ahead

# KV templates: global layer index filled in with %d (onnxruntime-genai's convention).
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"

# Dynamic dimension names.
BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST_SEQUENCE = "past_sequence_length"
TOTAL_SEQUENCE = "total_sequence_length"
PRESENT_SEQUENCE = "present_sequence_length"  # static draft only: its present holds the new slots alone

# Graph roles and their file names inside an export folder.
PREFIX = "prefix"
EXIT_HEAD = "exit_head"
SUFFIX = "suffix"
DRAFT = "draft"
GRAPH_ROLES = (PREFIX, EXIT_HEAD, SUFFIX, DRAFT)
DRAFT_STATIC = "draft_static"  # optional: the draft with fixed shapes for NPUs (mirrorsd-export --static-draft)
DRAFT_STREAMING = "draft_streaming"  # optional: the draft + n lookahead streams (mirrorsd-train-draft folder)
EXIT_SPARSE = "exit_sparse"  # optional: the exit head scoring candidate tokens only (mirrorsd-train-exit)
OPTIONAL_ROLES = (DRAFT_STATIC, DRAFT_STREAMING, EXIT_SPARSE)
MANIFEST_FILE = "mirrorsd.json"
PRECISIONS = ("fp32", "fp16", "int8", "int4")  # weight precisions of a model in an export (export/quantize.py);
#                                               fp16: weights and compute in half precision (GPU targets)
# validation count of a graph's MatMulNBits nodes with float zero points (carried GGUF Q4_K blocks): ONNX Runtime's own
# kernel runs those through another, slower path, whose row invariance devices/ort_kernel_check.py measures apart
FLOAT_ZERO_POINT_WEIGHTS = "float_zero_point_weights"
UNPACK_PREFIX = "unpack/"  # names of the nodes that unpack packed weights (export/packed_weights.py)
WEIGHT_BITS = {"int8": 8, "int4": 4}  # bits per weight of the quantized precisions (MatMulNBits)
TOKENIZER_DIR = "tokenizer"


def graph_file(role: str) -> str:
    return f"{role}.onnx"
