"""libmirrorsd (runtime/native, C++ on ONNX Runtime's C API) against the Python runtime, on tiny random models of
every architecture the exporter supports: C ar == Python ar token for token, C sd and C mirror == C ar in every
setting, and where the Python decoders are deterministic (sd; mirror with the "cap" budget and no exit head) the C
decoders take exactly the same steps, windows, acceptances, reuses and draft forwards: the same protocol and the same
branch ranking, not just the same output."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import ARCHS
from mirrorsd.runtime import GenerationConfig

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62], [5], list(range(20, 60))]
NEW = 40
SAME_PATH = ("steps", "drafted", "accepted", "windows", "reused", "fallbacks", "draft_forwards")
# settings of the speculative modes: (gamma, branches, branch_batch, budget, exit head)
GRID = [(1, 1, 1, "time", True), (3, 4, 2, "cap", True), (4, 4, 2, "time", False), (5, 6, 3, "cap", False)]


def check_counters(native_stats: dict, python_stats, what: str) -> None:
    got = {k: native_stats[k] for k in SAME_PATH}
    want = {k: getattr(python_stats, k) for k in SAME_PATH}
    assert got == want, what


@pytest.mark.parametrize("arch", ARCHS)
def test_native_modes_equal_python_ar(arch, exported, pipelines, native_models):
    folder = exported(arch, draft_layers=2)
    pipe, native = pipelines(folder), native_models(folder)
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
        c_ar = native.generate(prompt, mode="ar", max_new_tokens=NEW)
        assert c_ar.tokens == ar.tokens, (arch, prompt)
        check_counters(c_ar.stats, ar.stats, "ar")
        for gamma, branches, batch, budget, exit_head in GRID:
            settings = dict(max_new_tokens=NEW, gamma=gamma, branches=branches, branch_batch=batch)
            c_sd = native.generate(prompt, mode="sd", **settings)
            assert c_sd.tokens == c_ar.tokens, ("sd", arch, gamma, prompt)
            check_counters(c_sd.stats, pipe.generate(prompt, GenerationConfig(mode="sd", **settings)).stats, "sd")
            c_mirror = native.generate(prompt, mode="mirror", branch_budget=budget, exit_head=exit_head, **settings)
            assert c_mirror.tokens == c_ar.tokens, ("mirror", arch, gamma, budget, exit_head, prompt)
            stats = c_mirror.stats
            assert stats["accepted"] <= stats["drafted"] and stats["reused"] + stats["fallbacks"] == stats["windows"]
            if budget == "cap" and not exit_head:  # deterministic in both runtimes: the same path step by step
                py = pipe.generate(prompt, GenerationConfig(mode="mirror", branch_budget=budget, exit_head=False,
                                                            **settings))
                check_counters(stats, py.stats, f"mirror {arch} gamma {gamma}")


def test_a_prompt_longer_than_a_prefill_chunk_like_python(exported, pipelines, native_models):
    """A prompt of more than kPrefillChunk (= PREFILL_CHUNK) tokens is read in the same chunks by both hosts: C ar ==
    Python ar, and C sd takes Python sd's steps; both caches end holding the whole prompt."""
    from mirrorsd.runtime.models import PREFILL_CHUNK

    folder = exported("qwen2", draft_layers=2)
    pipe, native = pipelines(folder), native_models(folder)
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 380, PREFILL_CHUNK + 45)]
    ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW))
    c_ar = native.generate(prompt, mode="ar", max_new_tokens=NEW)
    assert c_ar.tokens == ar.tokens
    sd = pipe.generate(prompt, GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=3))
    c_sd = native.generate(prompt, mode="sd", max_new_tokens=NEW, gamma=3)
    assert c_sd.tokens == sd.tokens == ar.tokens
    check_counters(c_sd.stats, sd.stats, "sd, long prompt")
    c_mirror = native.generate(prompt, mode="mirror", max_new_tokens=NEW, gamma=3, branch_budget="cap")
    assert c_mirror.tokens == ar.tokens


def test_identical_draft_is_always_accepted_and_reused(exported, native_models):
    """A draft equal to the target: every drafted token is accepted, and Mirror-SD's best-ranked branch (the bonus)
    is the one the verdict wants, so windows come from pre-computed branches."""
    native = native_models(exported("llama", draft_layers=4))
    for prompt in PROMPTS[:2]:
        ar = native.generate(prompt, mode="ar", max_new_tokens=NEW)
        for mode in ("sd", "mirror"):
            out = native.generate(prompt, mode=mode, max_new_tokens=NEW, branch_budget="cap")
            assert out.tokens == ar.tokens and out.stats["acceptance_rate"] == 1.0
            if mode == "mirror":
                assert out.stats["reuse_rate"] > 0.5 and out.stats["branches_rolled_out"] > 0


def edited_copy(folder, tmp_path, edit) -> object:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "mirrorsd.json").read_text())
    edit(manifest)
    (copy / "mirrorsd.json").write_text(json.dumps(manifest))
    return copy


def test_stops_at_eos_and_context_like_python(exported, tmp_path, native_build):
    """The commit rules (EOS kept as the last token, the token budget, the context limit) are Python's."""
    from mirrorsd.runtime.native import NativeModel
    from mirrorsd.runtime import Pipeline

    folder = exported("qwen2", draft_layers=2)
    with Pipeline.load(folder) as pipe:
        reference = pipe.generate(PROMPTS[0], GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
    eos = reference[9]  # the tenth token's value: generation must stop where it first appears
    cases = {"eos": lambda m: m["tokenizer"].update(eos_token_ids=[eos]),
             "context": lambda m: (m["target"].update(max_position_embeddings=17),
                                   m["draft"].update(max_position_embeddings=17))}
    for reason, edit in cases.items():
        copy = edited_copy(folder, tmp_path / reason, edit)
        with Pipeline.load(copy) as pipe, NativeModel(copy, native_build.library) as native:
            for mode in ("ar", "sd", "mirror"):
                result = pipe.generate(PROMPTS[0], GenerationConfig(mode=mode, max_new_tokens=NEW))
                want = result.tokens
                got = native.generate(PROMPTS[0], mode=mode, max_new_tokens=NEW)
                assert got.tokens == want and got.stats["finish_reason"] == reason, (reason, mode)
                assert result.finish_reason == reason, (reason, mode)  # Python says why it stopped, as C++ does
                expected = reference.index(eos) + 1 if reason == "eos" else 17 - len(PROMPTS[0])
                assert len(got.tokens) == expected, (reason, mode)


def broken_draft(folder, tmp_path):
    """A copy of ``folder`` whose draft.onnx loads (it has every input the manifest names) but fails on every call
    (it has none of the outputs the manifest names)."""
    from onnx import TensorProto, helper

    copy = tmp_path / "broken-draft"
    shutil.copytree(folder, copy)
    spec = json.loads((copy / "mirrorsd.json").read_text())["graphs"]["draft"]
    types = {"int64": TensorProto.INT64, "float32": TensorProto.FLOAT}
    inputs = [helper.make_tensor_value_info(t["name"], types[t["dtype"]], None) for t in spec["inputs"]]
    out = helper.make_tensor_value_info("unrelated", TensorProto.INT64, None)
    graph = helper.make_graph([helper.make_node("Identity", [spec["inputs"][0]["name"]], ["unrelated"])], "broken",
                              inputs, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (copy / "draft.onnx").write_bytes(model.SerializeToString())
    for extra in copy.glob("draft.onnx.data"):
        extra.unlink()
    return copy


def test_failing_draft_raises_or_falls_back_like_python(exported, tmp_path, native_build):
    from mirrorsd.errors import DraftWorkerError
    from mirrorsd.runtime.native import NativeModel
    from mirrorsd.runtime import Pipeline

    folder = broken_draft(exported("llama", draft_layers=2), tmp_path)
    with Pipeline.load(folder) as pipe, NativeModel(folder, native_build.library) as native:
        ar = native.generate(PROMPTS[0], mode="ar", max_new_tokens=NEW)
        for mode in ("sd", "mirror"):
            with pytest.raises(DraftWorkerError, match="draft"):
                native.generate(PROMPTS[0], mode=mode, max_new_tokens=NEW)
            out = native.generate(PROMPTS[0], mode=mode, max_new_tokens=NEW, on_draft_failure="fallback")
            py = pipe.generate(PROMPTS[0], GenerationConfig(mode=mode, max_new_tokens=NEW,
                                                            on_draft_failure="fallback"))
            assert out.tokens == ar.tokens == py.tokens and out.stats["draft_failures"] == 1, mode
            check_counters(out.stats, py.stats, f"{mode} after a draft failure")
