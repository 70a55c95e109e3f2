"""A tiny Qwen2 GGUF file written with the ``gguf`` package: the tiny random model of tiny_models.py, its tokenizer,
and its weights quantized per tensor to the GGUF types asked for (gguf.quants), everything else float32."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# GGUF tensor of each layer -> the Hugging Face parameter it holds
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def write_gguf(hf_folder: Path, path: Path, types: dict[str, str], default: str = "F32") -> Path:
    """Write ``hf_folder`` (a tiny Qwen2 from tiny_models.build_model) as the GGUF ``path``. ``types``: GGUF tensor
    kind (``attn_q``, ``ffn_up``, ``output``, ``token_embd``...) -> GGML type name; norms and biases stay F32."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    weights = load_file(str(hf_folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_tokenizer(writer, hf_folder, config)

    def put(name: str, kind: str, array: np.ndarray) -> None:
        qtype = gguf.GGMLQuantizationType[types.get(kind, default) if array.ndim == 2 else "F32"]
        data = np.ascontiguousarray(array, np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    put("token_embd.weight", "token_embd", weights["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", "norm", weights[prefix + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", "norm", weights[prefix + "post_attention_layernorm.weight"])
        for kind, part in LAYER_TENSORS.items():
            put(f"blk.{i}.{kind}.weight", kind, weights[f"{prefix}{part}.weight"])
            if f"{prefix}{part}.bias" in weights:
                put(f"blk.{i}.{kind}.bias", kind, weights[f"{prefix}{part}.bias"])
    put("output_norm.weight", "norm", weights["model.norm.weight"])
    put("output.weight", "output", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, hf_folder: Path, config: dict) -> None:
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
