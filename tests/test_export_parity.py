"""Export every supported architecture at several exit layers; target-only decoding on the graphs must emit
exactly transformers' greedy tokens (single prompts and a left-padded batch of two)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import ARCHS
from oracle import check_tokens
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8], [5], [1, 300, 301, 302, 303, 304, 305]]
NEW_TOKENS = 32


def hf_greedy(folder, prompts, new_tokens, eos):
    """transformers' greedy generate: token ids per prompt and the top-2 margins of each chosen token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    results = []
    for row in range(len(prompts)):
        tokens, margins = [], []
        for step, score in enumerate(out.scores):
            token = int(out.sequences[row, width + step])
            top2 = torch.topk(score[row], 2).values
            tokens.append(token)
            margins.append(float(top2[0] - top2[1]))
            if token in eos:
                break
        results.append((tokens, margins))
    return results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_ar_on_graphs_equals_transformers_greedy(arch, where, exported, tiny_model, pipelines):
    layers = 4
    exit_layer = {"first": 1, "middle": layers // 2, "last": layers - 1}[where]
    folder = exported(arch, exit_layer=exit_layer)
    manifest = load_manifest(folder)
    assert manifest.exit_layer == exit_layer
    assert manifest.graphs["prefix"].layer_range == (0, exit_layer)
    assert manifest.graphs["suffix"].layer_range == (exit_layer, layers)
    assert all(manifest.graphs[r].validation for r in ("prefix", "exit_head", "suffix", "draft"))
    pipe = pipelines(folder)
    eos = manifest.tokenizer.eos_token_ids
    reference = hf_greedy(tiny_model(arch), PROMPTS, NEW_TOKENS, eos)
    ties = 0
    for prompt, (ref_tokens, margins) in zip(PROMPTS, reference):
        got = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS)).tokens
        ties += not check_tokens(ref_tokens, got, margins).identical
    assert ties == 0, f"{ties} near-tie divergences on peaked tiny models (expected none)"


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_equals_transformers(arch, exported, tiny_model, pipelines):
    folder = exported(arch)
    pipe = pipelines(folder)
    prompts = [PROMPTS[0], PROMPTS[1]]  # lengths 5 and 9: the first row is left-padded
    eos = pipe.manifest.tokenizer.eos_token_ids
    reference = hf_greedy(tiny_model(arch), prompts, NEW_TOKENS, eos)
    got = pipe.generate_batch(prompts, NEW_TOKENS)
    for (ref_tokens, margins), tokens in zip(reference, got):
        assert check_tokens(ref_tokens, tokens, margins).identical


def test_batch_rows_equal_single_runs(exported, pipelines):
    pipe = pipelines(exported("llama"))
    batch = pipe.generate_batch([PROMPTS[2], PROMPTS[3]], 16)
    for prompt, tokens in zip([PROMPTS[2], PROMPTS[3]], batch):
        assert pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=16)).tokens == tokens


def test_manifest_records_names_and_versions(exported):
    manifest = load_manifest(exported("qwen2"))
    prefix = manifest.graph("prefix")
    assert prefix.input_names()[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert "past_key_values.0.key" in prefix.input_names()
    suffix = manifest.graph("suffix")
    first_suffix_layer = manifest.exit_layer
    assert f"present.{first_suffix_layer}.key" in suffix.output_names()  # global layer indices
    exit_head = manifest.graph("exit_head")
    assert [t.shape[-1] for t in exit_head.outputs] == [manifest.top_k, manifest.top_k]
    assert {"torch", "transformers", "onnx", "onnxruntime"} <= set(manifest.versions)
    assert manifest.tokenizer.eos_token_ids


def test_split_costs_nothing_in_accuracy(exported):
    """Validation numbers in the manifest stay within the tolerance table (they failed the export otherwise)."""
    from mirrorsd.export.graphs.registry import module_for

    manifest = load_manifest(exported("llama"))
    for spec in manifest.graphs.values():
        for check, diff in spec.validation.items():
            assert check in module_for(spec.role).CHECKS and np.isfinite(diff) and diff < 1e-2
