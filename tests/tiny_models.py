"""Tiny random models and a tiny tokenizer, built from configs (no downloads), for every supported architecture.

Weights use a large init range so that logits are peaked: greedy argmax margins are then far above the
float32 noise between PyTorch and ONNX Runtime, and token parity is a meaningful, strict check.
"""
from __future__ import annotations

from pathlib import Path

VOCAB = 384
CORPUS = [
    "def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them.", "for i in range(10):\n    print(i)\n",
    "Hello, how are you today? I am fine, thank you.", "import numpy as np\nx = np.zeros(3)\n",
    "Mirror speculative decoding runs the draft and the target at the same time.",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")

CONFIGS = {
    "llama": dict(cls="LlamaConfig", extra={}),
    "qwen2": dict(cls="Qwen2Config", extra={}),
    "qwen3": dict(cls="Qwen3Config", extra={}),  # its head_dim defaults to 128: build_model sets hidden / heads
    "mistral": dict(cls="MistralConfig", extra={"sliding_window": None}),
}


def build_tokenizer(folder: Path, corpus: list[str] = CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_model(folder: Path, model_type: str = "llama", layers: int = 4, seed: int = 0, hidden: int = 64,
                init_range: float = 0.3, corpus: list[str] = CORPUS, max_positions: int = 512,
                vocab_size: int = VOCAB, heads: int = 4, kv_heads: int = 2, memoryless: bool = False) -> Path:
    """Write a tiny random causal LM + tokenizer as a Hugging Face folder and return the folder.

    ``vocab_size`` above the tokenizer's VOCAB tokens adds embedding rows that no token uses (as padded
    vocabularies do). ``memoryless``: attention outputs zero (o_proj = 0), so the next token depends on the current
    token alone and greedy text soon runs in a cycle (text that repeats, for prompt lookup)."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder, corpus)
    spec = CONFIGS[model_type]
    extra = {**spec["extra"], **({"head_dim": hidden // heads} if model_type == "qwen3" else {})}
    config = getattr(transformers, spec["cls"])(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        initializer_range=init_range,
        tie_word_embeddings=(model_type == "llama"), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if memoryless:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


QUESTION_WORDS = "def add return quick brown fox import numpy range print hello mirror decoding draft target".split()


def write_questions(folder: Path, count: int) -> Path:
    """A SpecBench-shaped question.jsonl of ``count`` random six-word questions in three categories (for trainers)."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    path = folder / "question.jsonl"
    rows = [{"question_id": i, "category": "abc"[i % 3], "turns": [" ".join(rng.choice(QUESTION_WORDS, 6))]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
