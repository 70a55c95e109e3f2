"""A tiny Qwen2 GGUF file written with the ``gguf`` package: the tiny random model of tiny_models.py, its tokenizer,
and its weights quantized per tensor to the GGUF types asked for (gguf.quants; Q4_K and Q5_K, which gguf.quants
cannot quantize, by k_quant_blocks here), everything else float32."""
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
        elif qtype.name in K_QUANT_LEVELS:
            writer.add_tensor(name, k_quant_blocks(data, qtype.name), raw_dtype=qtype)
        elif qtype.name == "Q6_K":
            writer.add_tensor(name, q6_k_blocks(data), raw_dtype=qtype)
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


K_QUANT_LEVELS = {"Q4_K": 15, "Q5_K": 31}  # largest code q


def k_quant_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    """w [N, K] (K a multiple of 256) as Q4_K or Q5_K blocks [N, K/256 * bytes], quantized min-max per sub-block of
    32 with 6-bit sub-block scales and mins under fp16 d and dmin (llama.cpp's layout, a simpler search). The first
    row's first sub-block gets sc = 0 (a constant block, -dmin*m) and its second sc = m = 0 (zeros): the corners."""
    top = K_QUANT_LEVELS[kind]
    n, k = w.shape
    sub = w.reshape(n, k // 256, 8, 32).astype(np.float64)
    offset = -np.minimum(sub.min(axis=-1), 0.0)  # [N, nb, 8], >= 0
    scale = (sub.max(axis=-1) + offset) / top
    d = (scale.max(axis=-1) / 63).astype(np.float16)  # [N, nb]
    dmin = (offset.max(axis=-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(offset / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    sc[0, 0, 0], sc[0, 0, 1], m[0, 0, 1] = 0, 0, 0
    step = d.astype(np.float64)[..., None] * sc
    shifted = sub + (dmin.astype(np.float64)[..., None] * m)[..., None]
    q = np.clip(np.rint(shifted / np.where(step > 0, step, 1)[..., None]), 0, top).astype(np.uint8)  # [N, nb, 8, 32]
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)  # [N, nb, 12]
    low = (q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)  # [N, nb, 4, 32]
    parts = [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), scales]
    if kind == "Q5_K":
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=-2))
    parts.append(low.reshape(n, -1, 128))
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(n, -1)


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


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """w [N, K] (K a multiple of 256) as Q6_K blocks [N, K/256 * 210]: per sub-block of 16 a signed 8-bit scale under
    one fp16 d per block, codes q - 32 in -32..31 (llama.cpp's layout: 128 bytes of low nibbles, 64 of 2-bit highs,
    16 int8 scales, d), round-to-nearest without llama.cpp's search."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float64)
    scale = np.abs(sub).max(axis=-1) / 31  # [N, nb, 16]
    d = (scale.max(axis=-1) / 127).astype(np.float16)  # [N, nb]
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1).astype(np.float64)[..., None]), -128, 127).astype(np.int8)
    step = d.astype(np.float64)[..., None] * sc
    q = (np.clip(np.rint(sub / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, -1, 2, 4, 32)  # [N, nb, half, quarter, 32]: weight 32 * quarter + i of each half of 128
    low = (q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)  # [N, nb, 2, 2, 32]: bytes i, 32 + i
    high = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | \
        ((q[:, :, :, 3] >> 4) << 6)  # [N, nb, 2, 32]
    parts = [low.reshape(n, -1, 128), high.reshape(n, -1, 64), sc.view(np.uint8).reshape(n, -1, 16),
             d.view(np.uint8).reshape(n, -1, 2)]
    return np.concatenate(parts, axis=-1).astype(np.uint8).reshape(n, -1)
