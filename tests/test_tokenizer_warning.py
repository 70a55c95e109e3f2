"""transformers 4.57.3+ warns "incorrect regex pattern ... This will lead to incorrect tokenization" for any local
folder whose config.json was saved by transformers 4.57.3-4.57.x and whose vocabulary exceeds 100,000 tokens: the
Qwen pair, converted here by 4.57.6, trips it. The warning is about Mistral's tokenizer and changes nothing unless
``fix_mistral_regex=True`` is passed. These tests show that for a Qwen-style tokenizer the tokens mirrorsd's loader
gets equal the tokenizer.json reference (and that the "fix" would change them), that the loader no longer prints
the warning there, and that it still does for Mistral, where the warning may be right.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mirrorsd.export.loading import load_tokenizer

TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "Hello, WORLD!  It's 2024; ünïcödé 数字",
         "  leading spaces\n\n\ttabs and CamelCaseWords123 x+=1", "I'm sure they'll've done it: 3.14159, 1e-9.",
         "An iPhone runs JavaScript: document.getElementById(id) and React's useState()."]  # Qwen keeps " iPhone" whole
QWEN = Path.home() / ".cache" / "mirrorsd" / "hf" / "qwen2.5-coder-1.5b"
WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # a GPT-2 style split


def qwen_style_folder(folder: Path, model_type: str) -> Path:
    """Byte-level BPE behind a regex Split pre-tokenizer (Qwen2's layout), 100,000+ tokens, a config.json saved by
    transformers 4.57.6: everything that makes transformers 4.57 warn."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    symbols = sorted(alphabet)
    merges = [(a, b) for a in symbols for b in symbols]  # 65,536 two-byte tokens
    merges += [(a + b, c) for a, b in merges[:160] for c in symbols][:40_000]  # and 40,000 three-byte ones
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "transformers_version": "4.57.6"}))
    return folder


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture()
def regex_warnings():
    """The warnings transformers' tokenizer loader logs about "incorrect regex pattern" during the test."""
    log, handler = logging.getLogger("transformers.tokenization_utils_base"), Records()
    log.addHandler(handler)
    yield lambda: [m for m in handler.messages if "incorrect regex pattern" in m]
    log.removeHandler(handler)


def reference_ids(folder: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [reference.encode(text, add_special_tokens=False).ids for text in TEXTS]


def test_plain_transformers_raises_the_false_alarm(tmp_path, regex_warnings):
    from transformers import AutoTokenizer

    folder = qwen_style_folder(tmp_path / "qwen", "qwen2")
    plain = AutoTokenizer.from_pretrained(folder)
    assert regex_warnings(), "transformers no longer warns here: the filter in export/loading.py can go"
    assert [plain.encode(t, add_special_tokens=False) for t in TEXTS] == reference_ids(folder)


def test_loader_is_quiet_for_qwen_and_tokenizes_as_the_reference(tmp_path, regex_warnings):
    folder = qwen_style_folder(tmp_path / "qwen", "qwen2")
    tokenizer = load_tokenizer(folder, "qwen2")
    assert not regex_warnings()
    assert [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS] == reference_ids(folder)


def test_loader_still_warns_for_mistral(tmp_path, regex_warnings):
    load_tokenizer(qwen_style_folder(tmp_path / "mistral", "mistral"), "mistral")
    assert regex_warnings()


@pytest.mark.slow
@pytest.mark.skipif(not (QWEN / "tokenizer.json").is_file(),
                    reason=f"no converted Qwen2.5-Coder folder at {QWEN} (mirrorsd fetch qwen2.5-coder-1.5b)")
def test_real_qwen_tokenizer_equals_its_reference_and_the_mistral_fix_would_change_it(regex_warnings):
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(QWEN, "qwen2")
    assert not regex_warnings()
    assert [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS] == reference_ids(QWEN)
    patched = AutoTokenizer.from_pretrained(QWEN, fix_mistral_regex=True)
    assert [patched.encode(t, add_special_tokens=False) for t in TEXTS] != reference_ids(QWEN)
