"""``genai_config.json``: the same export folder, loadable by onnxruntime-genai as a ``decoder-pipeline`` model.

onnxruntime-genai runs the target's two halves as a two-stage pipeline; the exit head and the draft are ours only:

    input_ids, attention_mask, position_ids, past_key_values.{0..L-1}.*  ->  prefix.onnx
        -> hidden_states (forwarded)  +  present.{0..L-1}.*
    hidden_states, attention_mask, position_ids, past_key_values.{L..N-1}.*  ->  suffix.onnx
        -> logits  +  present.{L..N-1}.*

onnxruntime-genai manages the KV cache of all N layers from one pair of ``%d`` templates filled with layer indices
0..N-1 and hands each stage the names it lists, so the suffix's *global* layer indices are exactly what it needs.

onnxruntime-genai parses this file strictly (checked with 0.18.0): an unknown key in any section, or an unknown
top-level object or array, fails with 'Unknown value "..."'. Only top-level scalars slip through, by a quirk of its
parser rather than a promise. So nothing of ours is written here: mirrorsd's own settings (exit layer, top-k, the
draft and exit-head graphs, tolerances) stay in ``mirrorsd.json`` beside it, which onnxruntime-genai never reads.
The tokenizer is found through ``tokenizer_dir``; no copies at the top of the folder are needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mirrorsd import names
from mirrorsd.errors import ManifestError
from mirrorsd.manifest import GraphSpec, Manifest

GENAI_CONFIG_FILE = "genai_config.json"
MODEL_TYPE = "decoder-pipeline"
# Sampling knobs of the model's generation config that do not change greedy decoding; anything else
# (repetition penalty, length limits) would make onnxruntime-genai's greedy tokens differ from ours.
SAMPLING_KEYS = ("temperature", "top_k", "top_p")


def genai_config(manifest: Manifest) -> dict[str, Any]:
    """The onnxruntime-genai config of an export folder, built from its manifest alone."""
    prefix, suffix = manifest.graph(names.PREFIX), manifest.graph(names.SUFFIX)
    _check_stages(prefix, suffix, manifest.target.num_layers)
    info, tok = manifest.target, manifest.tokenizer
    eos = list(tok.eos_token_ids)
    model: dict[str, Any] = {"type": MODEL_TYPE}
    if tok.bos_token_id is not None:
        model["bos_token_id"] = tok.bos_token_id
    if eos:  # without one onnxruntime-genai stops at max_length only, as mirrorsd does
        model["eos_token_id"] = eos
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    model.update({
        "pad_token_id": pad,
        "context_length": info.max_position_embeddings,
        "vocab_size": info.vocab_size,
        "tokenizer_dir": tok.directory,
        "decoder": _decoder(manifest, prefix, suffix),
    })
    return {"model": model, "search": _search(manifest)}


def write_genai_config(folder: Path, manifest: Manifest) -> Path:
    path = Path(folder) / GENAI_CONFIG_FILE
    path.write_text(json.dumps(genai_config(manifest), indent=2) + "\n", encoding="utf-8")
    return path


def _decoder(manifest: Manifest, prefix: GraphSpec, suffix: GraphSpec) -> dict[str, Any]:
    info, kv = manifest.target, prefix.kv
    ids_name, mask_name, positions_name = prefix.input_names()[:3]
    hidden_out, hidden_in = prefix.output_names()[0], suffix.input_names()[0]
    return {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": info.head_dim,
        "hidden_size": info.hidden_size,
        "num_attention_heads": info.num_attention_heads,
        "num_hidden_layers": info.num_layers,
        "num_key_value_heads": info.num_kv_heads,
        "inputs": {"input_ids": ids_name, "attention_mask": mask_name, "position_ids": positions_name,
                   "past_key_names": kv.past_key, "past_value_names": kv.past_value},
        "outputs": {"logits": suffix.output_names()[0], "present_key_names": kv.present_key,
                    "present_value_names": kv.present_value},
        "pipeline": [
            {names.PREFIX: _stage(prefix, forward={hidden_out: hidden_in})},
            {names.SUFFIX: _stage(suffix, forward={})},
        ],
    }


def _stage(spec: GraphSpec, forward: dict[str, str]) -> dict[str, Any]:
    stage: dict[str, Any] = {"filename": spec.file, "inputs": spec.input_names(), "outputs": spec.output_names()}
    if forward:
        stage["output_names_forwarder"] = forward  # hand the prefix's hidden state to the suffix's input
    stage.update({"run_on_prompt": True, "run_on_token_gen": True})
    return stage


def _search(manifest: Manifest) -> dict[str, Any]:
    search: dict[str, Any] = {
        "do_sample": False,  # mirrorsd decodes greedily; a user may switch sampling on in onnxruntime-genai
        "max_length": manifest.target.max_position_embeddings,
        "min_length": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": False,  # present = concat(past, new): the graphs grow the cache themselves
        "repetition_penalty": 1.0,
    }
    defaults = manifest.generation_defaults
    for key in SAMPLING_KEYS:
        value = defaults.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            search[key] = int(value) if key == "top_k" else float(value)
    return search


def _check_stages(prefix: GraphSpec, suffix: GraphSpec, num_layers: int) -> None:
    """onnxruntime-genai fills one template per KV kind for layers 0..N-1: both halves must share it and tile N."""
    if prefix.kv is None or suffix.kv is None:
        raise ManifestError("The prefix or suffix graph has no KV cache", "onnxruntime-genai manages KV itself",
                                "re-export the folder with this version of mirrorsd-export")
    templates = lambda kv: (kv.past_key, kv.past_value, kv.present_key, kv.present_value)  # noqa: E731
    if templates(prefix.kv) != templates(suffix.kv):
        raise ManifestError("The prefix and suffix use different KV name templates",
                                "onnxruntime-genai takes one template per KV kind for the whole model",
                                "re-export the folder with this version of mirrorsd-export")
    if prefix.kv.layers[0] != 0 or prefix.kv.layers[1] != suffix.kv.layers[0] or suffix.kv.layers[1] != num_layers:
        raise ManifestError(
            f"The KV layers {prefix.kv.layers} + {suffix.kv.layers} do not cover layers 0..{num_layers - 1}",
            "onnxruntime-genai expects the stages' global layer indices to tile the model",
            "re-export the folder with this version of mirrorsd-export")
