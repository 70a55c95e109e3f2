"""A prompt is read PREFILL_CHUNK tokens per forward (runtime/models.py): the target's and the draft's caches end
holding the whole prompt, the first token is the one a single forward over the prompt picks, every mode still emits
ar's tokens, a left-padded batch is read in chunks too, and the C++ library reads a prompt in the same chunks as the
Python runtime."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from mirrorsd.runtime import GenerationConfig, models

CHUNK = 8  # small, so the tiny models' prompts span several chunks
PROMPTS = [list(range(20, 60)), [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62] * 3, list(range(100, 108)),
           list(range(300, 309))]
NEW = 24


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(models, "PREFILL_CHUNK", CHUNK)


def test_chunked_prefill_fills_the_cache_and_picks_the_same_first_token(exported, pipelines):
    pipe = pipelines(exported("qwen2", draft_layers=2))
    prompt = PROMPTS[0]  # 40 tokens: 5 chunks of 8
    pipe.target.reset(1, 64)
    whole = pipe.target.extend(prompt)[-1:]  # [1, vocab]: one forward over the prompt
    pipe.target.reset(1, 64)
    pipe.target_timeline.clear()
    chunked = pipe.target.prefill(prompt, chunk=CHUNK)
    assert pipe.target.length == len(prompt)
    assert len(pipe.target_timeline.intervals) == 2 * 5  # prefix and suffix, once per chunk
    assert chunked.shape == whole.shape
    assert int(np.argmax(chunked)) == int(np.argmax(whole))
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)
    # the cached keys of the first chunk are the ones the single forward wrote
    pipe.target.truncate(CHUNK)
    again = pipe.target.prefill(prompt[CHUNK:], chunk=CHUNK)
    np.testing.assert_array_equal(again, chunked)


def test_draft_prefill_reads_the_prompt_into_its_cache(exported, pipelines):
    pipe = pipelines(exported("llama", draft_layers=2))
    pipe.draft.reset(capacity=8)
    pipe.draft.prefill(PROMPTS[1], chunk=CHUNK)
    assert pipe.draft.cache.length == len(PROMPTS[1])
    assert pipe.draft.cache_tokens == PROMPTS[1]


def test_empty_prefill_is_refused(exported, pipelines):
    pipe = pipelines(exported("llama", draft_layers=2))
    pipe.target.reset(1, 8)
    with pytest.raises(ValueError, match="at least one token"):
        pipe.target.prefill([])


@pytest.mark.parametrize("draft", ["identical", "truncated"])
def test_every_mode_equals_ar_with_chunked_prompts(draft, exported, pipelines, small_chunks):
    folder = exported("llama", draft_layers=4 if draft == "identical" else 2)
    pipe = pipelines(folder)
    configs = [dict(mode="sd", gamma=3), dict(mode="sd", gamma=4, draft_confidence=0.8, ngram=True),
               dict(mode="mirror", gamma=3, branch_budget="cap"), dict(mode="ngram", gamma=4)]
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        for config in configs:
            out = pipe.generate(prompt, GenerationConfig(max_new_tokens=NEW, **config))
            assert out.tokens == ar.tokens, (config, prompt)
            if draft == "identical" and config["mode"] == "sd":
                assert out.stats.acceptance_rate == 1.0  # the draft read the whole prompt
        if len(prompt) > CHUNK:  # sd left the draft's cache holding the prompt, read in chunks
            assert pipe.draft.cache_tokens[:len(prompt)] == prompt


def test_a_left_padded_batch_reads_its_prompts_in_chunks(exported, pipelines, small_chunks):
    """generate_batch reads its left-padded prompts CHUNK columns a forward (a chunk of the shorter row may be all
    padding), and each row still decodes what ar decodes for it alone."""
    from mirrorsd.runtime.batch import left_pad, prefill_batch

    pipe = pipelines(exported("llama", draft_layers=2))
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]  # 40, 8 and 36 tokens: the second row is padding for 4 chunks
    ids, mask = left_pad(prompts, 0)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    pipe.target.reset(len(prompts), 64)
    whole = pipe.target.forward(ids, mask, positions)[:, -1]  # [B, vocab]: one forward over the batch
    pipe.target.reset(len(prompts), 64)
    pipe.target_timeline.clear()
    chunked = prefill_batch(pipe.target, ids, mask, positions)
    assert len(pipe.target_timeline.intervals) == 2 * 5  # 40 columns: prefix and suffix, once per chunk
    assert pipe.target.length == ids.shape[1]
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)
    batch = pipe.generate_batch(prompts, NEW)
    for prompt, tokens in zip(prompts, batch):
        assert tokens == pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens


@pytest.mark.parametrize("mode", ["ar", "sd", "mirror"])
def test_a_long_prompt_reports_its_progress_chunk_by_chunk(mode, exported, pipelines, small_chunks):
    """Each model reports after every chunk of a prompt longer than one (what mirrorsd generate's bars show); a prompt
    of one chunk reports nothing."""
    pipe = pipelines(exported("llama", draft_layers=2))
    calls = []
    pipe.target.on_prefill = pipe.draft.on_prefill = lambda model, read, total: calls.append((model, read, total))
    try:
        pipe.generate(PROMPTS[0], GenerationConfig(mode=mode, max_new_tokens=4))  # 40 tokens: 5 chunks of 8
        target = [c for c in calls if c[0] == "target"]
        assert target == [("target", n, 40) for n in (0, 8, 16, 24, 32, 40)]  # before the first chunk, after each
        draft = [c for c in calls if c[0] == "draft"]
        if mode == "ar":
            assert not draft
        else:  # the draft reads the prompt too (sd: its first window; mirror: its worker), chunk by chunk, to the end
            assert draft and [r for _, r, _ in draft] == sorted(r for _, r, _ in draft) and draft[-1][1] == draft[-1][2]
        calls.clear()
        pipe.generate(PROMPTS[2], GenerationConfig(mode=mode, max_new_tokens=4))  # 8 tokens: one chunk
        assert not calls
    finally:
        pipe.target.on_prefill = pipe.draft.on_prefill = None


def test_mirrorsd_generate_shows_a_bar_while_it_reads_a_long_prompt(exported, tmp_path, capsys, small_chunks):
    from mirrorsd.apps.cli import main

    folder = exported("llama", draft_layers=2)
    path = tmp_path / "long.txt"
    path.write_text("the sea and the sky and the sand " * 12, encoding="utf-8")
    assert main(["generate", "--model", str(folder), "--prompt-file", str(path), "--raw", "--mode", "sd",
                 "--max-new-tokens", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert "reading the prompt (target)" in captured.err
    assert "reading the prompt" not in captured.out  # stdout holds the JSON alone
    assert json.loads(captured.out)["tokens"]


def test_the_native_library_uses_the_same_chunk():
    header = Path(__file__).resolve().parents[1] / "runtime" / "native" / "src" / "models.hpp"
    found = re.search(r"constexpr int64_t kPrefillChunk = (\d+);", header.read_text())
    assert found, "models.hpp no longer defines kPrefillChunk"
    assert int(found.group(1)) == models.PREFILL_CHUNK
