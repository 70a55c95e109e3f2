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

# Graph roles and their file names inside an export folder.
PREFIX = "prefix"
EXIT_HEAD = "exit_head"
SUFFIX = "suffix"
DRAFT = "draft"
GRAPH_ROLES = (PREFIX, EXIT_HEAD, SUFFIX, DRAFT)
MANIFEST_FILE = "mirrorsd.json"
TOKENIZER_DIR = "tokenizer"


def graph_file(role: str) -> str:
    return f"{role}.onnx"
