"""mirrorsd-export --draft-vocab N: the draft's LM head scores only N ids. Its logits equal the full draft's at those
ids and hold the floor everywhere else (fp32 and int4 heads); sd and mirror still emit exactly ar's tokens, greedy
and sampled with the exact rule, down to a one-id subset the target never picks; bad N is refused before any graph
is written; the ranking follows the tokenizer (special tokens, alphabet, merge order)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from mirrorsd import names
from mirrorsd.errors import ExportOptionError, IncompatibleDraftError
from mirrorsd.export import vocab_subset
from mirrorsd.export.pipeline import ExportOptions, export
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig

N = 100
DRAFT_LAYERS = 3
PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62], [5]]


@pytest.fixture(scope="module")
def subset_exports(tmp_path_factory, tiny_model, exported):
    """{"full": the plain export, N: the same with --draft-vocab N, 1: with --draft-vocab 1}."""
    folders = {"full": exported("llama", draft_layers=DRAFT_LAYERS)}
    for n in (N, 1):
        out = tmp_path_factory.mktemp(f"vocab-{n}") / "out"
        export(ExportOptions(model=tiny_model("llama"), output=out, draft_layers=DRAFT_LAYERS, draft_vocab=n))
        folders[n] = out
    return folders


def draft_logits(path, vocab, kv):
    from mirrorsd.export.validate import Run, FileRunner, sample_batch

    ids, mask, positions = sample_batch(vocab, seed=5)
    feeds = {names.INPUT_IDS: ids, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
    return FileRunner(path, kv).run([Run("full", feeds)])["full"][names.LOGITS], mask.astype(bool)


def expected_ids(folder, vocab, n):
    from transformers import AutoTokenizer

    return vocab_subset.subset_ids(AutoTokenizer.from_pretrained(folder / names.TOKENIZER_DIR), vocab, n)


def test_subset_logits_are_the_full_logits_on_the_subset(subset_exports):
    full, cut = load_manifest(subset_exports["full"]), load_manifest(subset_exports[N])
    vocab, kv = cut.draft.vocab_size, cut.graph(names.DRAFT).kv
    assert cut.draft_vocab_subset.size == N and cut.draft_vocab_subset.order == vocab_subset.ORDER
    assert full.draft_vocab_subset is None and cut.export_options["draft_vocab"] == N
    assert cut.graph(names.DRAFT).outputs == full.graph(names.DRAFT).outputs  # the runtime's contract is unchanged
    assert 0 <= cut.graph(names.DRAFT).validation[vocab_subset.CHECK] <= 1e-4
    want, valid = draft_logits(subset_exports["full"] / "draft.onnx", vocab, kv)
    got, _ = draft_logits(subset_exports[N] / "draft.onnx", vocab, kv)
    ids = expected_ids(subset_exports[N], vocab, N)
    outside = np.setdiff1d(np.arange(vocab), ids)
    np.testing.assert_allclose(got[valid][:, ids], want[valid][:, ids], rtol=1e-5, atol=1e-5)
    assert np.all(got[..., outside] == vocab_subset.FLOOR)
    assert len(ids) == N and set(cut.tokenizer.eos_token_ids) <= set(ids.tolist())  # special tokens always in


def test_int4_head_keeps_its_quantized_rows(tmp_path, tiny_model):
    """An int4 draft's MatMulNBits head cut to the subset gives the full int4 graph's logits at those ids."""
    import onnx

    out = tmp_path / "int4"
    export(ExportOptions(model=tiny_model("llama"), output=out, draft_layers=DRAFT_LAYERS, draft_precision="int4"))
    manifest = load_manifest(out)
    vocab, kv = manifest.draft.vocab_size, manifest.graph(names.DRAFT).kv
    ids = np.array([0, 2, 5, 77, 200, vocab - 1])
    cut = tmp_path / "cut" / "draft.onnx"
    cut.parent.mkdir()
    shutil.copy(out / "draft.onnx", cut)
    diff = vocab_subset.restrict_file(cut, ids, vocab, kv)
    ops = [n.op_type for n in onnx.load(str(cut)).graph.node]
    heads = [n for n in onnx.load(str(cut)).graph.node if n.op_type == "MatMulNBits" and "vocab_subset" in n.input[1]]
    assert len(heads) == 1 and {a.name: a.i for a in heads[0].attribute}["N"] == len(ids) and "Gather" in ops
    want, valid = draft_logits(out / "draft.onnx", vocab, kv)
    got, _ = draft_logits(cut, vocab, kv)
    assert diff <= 1e-5
    np.testing.assert_allclose(got[valid][:, ids], want[valid][:, ids], rtol=1e-5, atol=1e-5)
    assert np.all(np.delete(got, ids, axis=-1) == vocab_subset.FLOOR)


@pytest.mark.parametrize("n", [N, 1])
def test_modes_equal_ar_with_a_subset_draft(n, subset_exports, pipelines):
    pipe = pipelines(subset_exports[n])
    subset = set(expected_ids(subset_exports[n], load_manifest(subset_exports[n]).draft.vocab_size, n).tolist())
    disjoint = 0
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24))
        disjoint += not subset & set(ar.tokens)
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=24, gamma=3, branches=4))
            assert out.tokens == ar.tokens, (n, mode, prompt)
            assert out.stats.drafted > 0
            if not subset & set(ar.tokens):  # the draft can only propose ids that the target never picked here
                assert out.stats.accepted == 0
    assert n != 1 or disjoint == len(PROMPTS)  # the one-id draft never agrees: every window is rejected


def test_sampling_exact_rule_equals_ar_with_a_subset_draft(subset_exports, pipelines):
    pipe = pipelines(subset_exports[N])
    sampled = dict(do_sample=True, temperature=1.5, top_k=5, top_p=0.95, repetition_penalty=1.3, max_new_tokens=20)
    for seed in range(3):
        ar = pipe.generate(PROMPTS[0], GenerationConfig(mode="ar", seed=seed, **sampled))
        for mode in ("sd", "mirror"):
            out = pipe.generate(PROMPTS[0], GenerationConfig(mode=mode, verify="exact", seed=seed, gamma=2, **sampled))
            assert out.tokens == ar.tokens, (mode, seed)


@pytest.mark.parametrize("n", [0, -3, 10**9])
def test_bad_subset_size_is_refused_before_writing(n, tmp_path, tiny_model):
    out = tmp_path / "out"
    with pytest.raises(ExportOptionError, match="--draft-vocab"):
        export(ExportOptions(model=tiny_model("llama"), output=out, draft_layers=DRAFT_LAYERS, draft_vocab=n))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_static_draft_with_subset_is_refused(tmp_path, tiny_model):
    with pytest.raises(ExportOptionError, match="--static-draft"):
        export(ExportOptions(model=tiny_model("llama"), output=tmp_path / "out", draft_layers=DRAFT_LAYERS,
                             draft_vocab=N, static_draft=True))
    assert not list(tmp_path.iterdir())


def test_draft_of_another_vocabulary_is_refused(tmp_path):
    from tiny_models import VOCAB, build_model

    target = build_model(tmp_path / "target", layers=2)
    draft = build_model(tmp_path / "draft", layers=1, vocab_size=VOCAB + 64)
    with pytest.raises(IncompatibleDraftError):
        export(ExportOptions(model=target, draft=draft, output=tmp_path / "out", draft_vocab=N))
    assert not (tmp_path / "out").exists()


def test_token_order_follows_the_tokenizer():
    tokenizer = {
        "added_tokens": [{"id": 9, "content": "<|eos|>"}, {"id": 1, "content": "<|bos|>"}],
        "model": {"type": "BPE", "vocab": {"a": 0, "<|bos|>": 1, "b": 2, "c": 3, "ab": 4, "abc": 5, "bc": 6,
                                           "ca": 7, "[PAD8]": 8, "<|eos|>": 9},
                  "merges": ["b c", "a b", "ab c", ["c", "a"]]},
    }
    # added tokens by id; the alphabet by id; merges in rank order; tokens no merge makes (8); unknown ids (10)
    assert vocab_subset.token_order(tokenizer, 11).tolist() == [1, 9, 0, 2, 3, 6, 4, 5, 7, 8, 10]
    unigram = {"model": {"type": "Unigram", "vocab": [["x", -3.0], ["y", -1.0], ["z", -2.0]]}}
    assert vocab_subset.token_order(unigram, 4).tolist() == [1, 2, 0, 3]
    assert vocab_subset.token_order({"model": {"type": "WordLevel"}}, 3).tolist() == [0, 1, 2]
