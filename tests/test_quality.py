"""``mirrorsd eval``: perplexity and top-1 agreement on real ONNX Runtime sessions of tiny exported models.

Two models with known answers:
- a *predictive* model whose weights make it predict the test text exactly: every layer's attention and MLP write
  nothing (o_proj, down_proj = 0), so the logits depend on the current token alone; the text's tokens get
  orthonormal embeddings and the LM head maps each to the token that follows it in the text (the text is a cycle,
  so each token has one successor). Its perplexity is ~1.
- a near-uniform model (random weights at a tiny init range): logits ~0, perplexity ~vocab.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mirrorsd.errors import GenerationInputError
from mirrorsd.apps.quality import DEFAULT_TEXT, EvalOptions, evaluate, score_window, table, windows
from tiny_models import VOCAB, build_model

CYCLE_TEXT = "The quick brown fox jumps over the lazy dog. " * 36  # 15 tokens a sentence: ~540 tokens
SCALE = 4.0  # LM-head weight: the right token's logit is SCALE * sqrt(hidden) = 32 above every other


def successors(ids: list[int]) -> dict[int, int]:
    nxt: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        assert nxt.setdefault(a, b) == b, f"token {a} has two successors: the text must be a cycle"
    return nxt


def build_predictive(folder: Path, text: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_model(folder, "qwen2", layers=2)
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    nxt = successors(ids)
    model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    hidden = model.config.hidden_size
    tokens = sorted(nxt)
    assert len(tokens) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        basis, _ = torch.linalg.qr(torch.randn(hidden, len(tokens), generator=torch.Generator().manual_seed(0)))
        model.lm_head.weight.zero_()
        for i, t in enumerate(tokens):
            model.model.embed_tokens.weight[t] = basis[:, i]  # unit length: RMSNorm scales it to sqrt(hidden)
            model.lm_head.weight[nxt[t]] += SCALE * basis[:, i]
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def cycle_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "cycle.txt"
    path.write_text(CYCLE_TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"predictive"|"uniform": (HF folder, fp32 export folder)}."""
    from mirrorsd.export.pipeline import ExportOptions, export

    made = {}
    base = tmp_path_factory.mktemp("quality")
    for name in ("predictive", "uniform"):
        hf = base / f"hf-{name}"
        if name == "predictive":
            build_predictive(hf, CYCLE_TEXT)
        else:
            build_model(hf, "qwen2", layers=2, init_range=0.002)
        out = base / f"export-{name}"
        export(ExportOptions(model=hf, output=out))
        made[name] = (hf, out)
    return made


def test_score_window_matches_a_direct_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32)
    ids = rng.integers(0, 11, size=5)
    nll, top1 = score_window(logits, ids)
    direct = np.log(np.exp(logits[:-1]).sum(-1)) - logits[np.arange(4), ids[1:]]
    np.testing.assert_allclose(nll, direct, rtol=1e-6)
    assert (top1 == logits[:-1].argmax(-1)).all() and nll.shape == (4,)


def test_windows_drop_a_last_window_that_scores_nothing():
    assert [w.tolist() for w in windows(list(range(7)), 3)] == [[0, 1, 2], [3, 4, 5]]
    assert [w.size for w in windows(list(range(8)), 3)] == [3, 3, 2]


def test_predictive_model_has_perplexity_one_and_agrees_with_its_source(models, cycle_text):
    hf, export = models["predictive"]
    result = evaluate(EvalOptions((export,), reference=hf, text=cycle_text, window=128), progress=False)
    row, ref = result.rows[0], result.reference
    assert result.tokens > 500 and row.tokens == result.tokens - len(windows(list(range(result.tokens)), 128))
    assert row.perplexity < 1.001 and ref.perplexity < 1.001
    assert row.agreement == 1.0
    assert row.kind == "export" and ref.kind == "hf" and row.size_bytes > 0
    assert "| 1.0000 |" in table(result)


def test_uniform_model_has_perplexity_near_the_vocabulary(models, cycle_text):
    _, uniform = models["uniform"]
    _, predictive = models["predictive"]
    result = evaluate(EvalOptions((uniform,), reference=predictive, text=cycle_text, max_tokens=200),
                      progress=False)
    row = result.rows[0]
    assert result.tokens == 200 and row.tokens == 199
    full = evaluate(EvalOptions((uniform,), text=cycle_text, max_tokens=200, window=100), progress=False).rows[0]
    half = evaluate(EvalOptions((uniform,), text=cycle_text, max_tokens=200, window=100, score_from=50),
                    progress=False).rows[0]
    assert full.tokens == 2 * 99 and half.tokens == 2 * 49  # each window scores its positions 50..98
    np.testing.assert_array_equal(half.nll, np.concatenate([full.nll[50:99], full.nll[149:]]))
    assert 0.95 * VOCAB < row.perplexity < 1.05 * VOCAB
    assert row.agreement < 0.2  # it does not predict the cycle


def test_shipped_text_scores_through_the_cli(models, capsys):
    from mirrorsd.apps.cli import main

    assert DEFAULT_TEXT.is_file() and len(DEFAULT_TEXT.read_text().split()) > 500
    _, export = models["uniform"]
    assert main(["eval", "--model", str(export), "--role", "draft", "--max-tokens", "64", "--kernels", "ort",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 64 and out["reference"] is None and out["rows"][0]["top1_agreement"] is None
    assert 0.9 * VOCAB < out["rows"][0]["perplexity"] < 1.1 * VOCAB


@pytest.mark.parametrize("change, message", [
    (dict(text=Path("/nonexistent/text.txt")), "does not exist"),
    (dict(window=1), "--window 1 is too small"),
    (dict(max_tokens=1), "--max-tokens 1 is too small"),
    (dict(models=(Path("/nonexistent"),)), "is not a folder"),
    (dict(role="exit"), "not a model of an export"),
    (dict(window=8, score_from=7), "--score-from 7 is out of range"),
])
def test_bad_input_is_a_clear_error(models, cycle_text, change, message):
    _, export = models["uniform"]
    options = dict(models=(export,), text=cycle_text, max_tokens=16)
    with pytest.raises(GenerationInputError, match=message):
        evaluate(EvalOptions(**{**options, **change}), progress=False)


def test_empty_text_and_a_folder_without_a_model_are_errors(models, tmp_path):
    _, export = models["uniform"]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(GenerationInputError, match="is empty"):
        evaluate(EvalOptions((export,), text=empty), progress=False)
    with pytest.raises(GenerationInputError, match="holds no model"):
        evaluate(EvalOptions((tmp_path,)), progress=False)


def test_a_reference_with_another_tokenizer_is_refused(models, tmp_path, cycle_text):
    _, export = models["uniform"]
    other = build_model(tmp_path / "other", "qwen2", layers=1, corpus=["zzz yyy xxx www"] * 50)
    with pytest.raises(GenerationInputError, match="tokenizes the text differently"):
        evaluate(EvalOptions((export,), reference=other, text=cycle_text, max_tokens=32), progress=False)
