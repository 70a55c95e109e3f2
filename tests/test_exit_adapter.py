"""The trained early exit (mirrorsd-train-exit): the adapter's graph equals its PyTorch module, training lowers the
held-out loss where the answer is learnable, the sparse head's scores equal the full head's at the gathered ids, and
sd/mirror with the trained (sparse) exit still emit exactly the ar tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mirrorsd import names
from mirrorsd.manifest import load_manifest
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime.verify import candidate_logprobs, exit_candidates, rank_branches
from tiny_models import write_questions

PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62], [5], list(range(20, 60))]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def head(exported):
    """(export folder, exit_head model, W [H, V], b [V], hidden size)."""
    from mirrorsd.export.early_exit import graph

    folder = exported("llama", draft_layers=2)
    manifest = load_manifest(folder)
    model = onnx.load(str(folder / manifest.graph(names.EXIT_HEAD).file))
    weight, bias = graph.head_weight(model, manifest.target.hidden_size)
    return folder, model, weight, bias, manifest.target.hidden_size


def random_adapter(hidden: int, rank: int = 4, seed: int = 1):
    from mirrorsd.export.early_exit.adapter import ExitAdapter

    adapter = ExitAdapter(hidden, rank, seed)
    with torch.no_grad():
        adapter.up.copy_(torch.randn(rank, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return adapter


def test_head_weight_is_the_models_lm_head(head, tiny_model):
    import transformers

    _, _, weight, bias, _ = head
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model("llama", 4)))
    np.testing.assert_allclose(weight, model.lm_head.weight.detach().numpy().T, atol=1e-6)
    assert not np.any(bias)


def test_adapter_graph_equals_its_pytorch_module(head):
    from mirrorsd.export.early_exit import graph
    from mirrorsd.export.early_exit.adapter import head_logits

    _, model, weight, bias, hidden = head
    adapter = random_adapter(hidden)
    adapted = graph.with_adapter(model, adapter.down.detach().numpy(), adapter.up.detach().numpy())
    h = np.random.default_rng(0).standard_normal((2, 5, hidden)).astype(np.float32)
    ids, logprobs = session(adapted).run([names.TOPK_IDS, names.TOPK_LOGPROBS], {names.HIDDEN_STATES: h})
    x = session(graph.trunk(model)).run(None, {names.HIDDEN_STATES: h})[0]
    with torch.no_grad():
        logits = head_logits(adapter(torch.from_numpy(x)), torch.from_numpy(weight), None)
        want = torch.topk(torch.log_softmax(logits, -1), ids.shape[-1], -1)
    np.testing.assert_allclose(logprobs, want.values.numpy(), atol=1e-4)
    assert (ids == want.indices.numpy()).mean() > 0.95  # near-ties may swap
    plain = session(model).run([names.TOPK_LOGPROBS], {names.HIDDEN_STATES: h})[0]
    assert np.abs(plain - logprobs).max() > 1e-2  # the adapter changed the exit (the test can fail)


def test_untrained_adapter_is_the_plain_exit_head(head):
    from mirrorsd.export.early_exit import graph
    from mirrorsd.export.early_exit.adapter import ExitAdapter

    _, model, _, _, hidden = head
    adapter = ExitAdapter(hidden, 8)
    adapted = graph.with_adapter(model, adapter.down.detach().numpy(), adapter.up.detach().numpy())
    h = np.random.default_rng(1).standard_normal((1, 7, hidden)).astype(np.float32)
    a = session(adapted).run(None, {names.HIDDEN_STATES: h})
    b = session(model).run(None, {names.HIDDEN_STATES: h})
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-6)


def test_training_lowers_heldout_loss_where_the_answer_is_learnable(head):
    """Labels from a planted rank-4 map before the model's own LM head: a rank-8 adapter can learn them."""
    from mirrorsd.export.early_exit.adapter import FitOptions, fit, head_logits

    _, _, weight, _, hidden = head
    planted = random_adapter(hidden, rank=4, seed=3)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3000, hidden)).astype(np.float32)
    with torch.no_grad():
        labels = head_logits(planted(torch.from_numpy(x)), torch.from_numpy(weight), None).argmax(-1).numpy()
    torch.set_num_threads(1)
    result = fit(x[:2500], labels[:2500], x[2500:], labels[2500:], torch.from_numpy(weight), None,
                 FitOptions(rank=8, epochs=8, batch=128, lr=1e-2))
    assert result.after.loss < 0.7 * result.before.loss
    assert result.after.hit[4] > result.before.hit[4] + 0.2
    assert result.history[-1] < result.history[0]


def test_sparse_head_scores_equal_the_full_heads_at_the_gathered_ids(head):
    from mirrorsd.export.early_exit import graph

    _, model, weight, bias, hidden = head
    adapter = random_adapter(hidden)
    adapted = graph.with_adapter(model, adapter.down.detach().numpy(), adapter.up.detach().numpy())
    sparse = session(graph.sparse_head(adapted, weight, bias))
    full = session(adapted)
    h = np.random.default_rng(4).standard_normal((1, 6, hidden)).astype(np.float32)
    top_ids, top_lps = full.run([names.TOPK_IDS, names.TOPK_LOGPROBS], {names.HIDDEN_STATES: h})
    scores = sparse.run(None, {names.HIDDEN_STATES: h, names.CANDIDATE_IDS: top_ids})[0]  # [1, 6, k]
    # log-probs are logits minus one log-normaliser per row: the difference is constant along each row
    offset = scores - top_lps
    np.testing.assert_allclose(offset, offset[..., :1].repeat(offset.shape[-1], -1), atol=1e-4)
    # and the logits themselves, against the head's own logits (the head_only cut of the adapted graph)
    x = session(graph.trunk(adapted)).run(None, {names.HIDDEN_STATES: h})[0]
    logits = x @ weight + bias  # trunk(adapted) is the adapted LM-head input
    np.testing.assert_allclose(scores, np.take_along_axis(logits, top_ids, -1), atol=1e-4)
    half = session(graph.sparse_head(adapted, weight, bias, np.float16))
    rough = half.run(None, {names.HIDDEN_STATES: h, names.CANDIDATE_IDS: top_ids})[0]
    np.testing.assert_allclose(rough, scores, atol=2e-2 * max(1.0, np.abs(scores).max()))


def test_candidate_logprobs_and_ranking_skip_missing_candidates():
    cands = exit_candidates(np.array([[5, 6], [7, 8]]), 3)
    assert cands.tolist() == [[5, 6], [7, 8], [-1, -1]]
    ids, lps = candidate_logprobs(cands, np.array([[0.0, 1.0], [2.0, 2.0], [0.0, 0.0]], np.float32))
    assert ids.tolist() == [[6, 5], [7, 8], [-1, -1]]
    np.testing.assert_allclose(np.exp(lps[:2]).sum(-1), 1.0, rtol=1e-6)
    assert np.isneginf(lps[2]).all()
    window = np.array([6, 7])
    draft_ids = np.array([[6, 5], [7, 9], [3, 4]])
    draft_lps = np.log(np.array([[0.6, 0.3], [0.5, 0.4], [0.7, 0.2]]))
    alone = rank_branches(window, draft_ids, draft_lps)
    with_exit = rank_branches(window, draft_ids, draft_lps, ids, lps)
    bonus = {b.token: b.score for b in with_exit if b.depth == 3}
    assert bonus == {b.token: b.score for b in alone if b.depth == 3}  # the exit lists nothing after the window


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    return write_questions(tmp_path_factory.mktemp("questions"), 24)


@pytest.fixture(scope="module")
def trained(head, questions, tmp_path_factory):
    from mirrorsd.export.early_exit.options import ExitTrainOptions
    from mirrorsd.export.early_exit.train import train

    folder = head[0]
    out = tmp_path_factory.mktemp("exit") / "out"
    options = ExitTrainOptions(model=folder, output=out, prompts=questions, train_prompts=12, eval_prompts=4,
                               holdout=2, max_new_tokens=24, rank=8, epochs=4, batch=64, lr=1e-2, threads=1,
                               progress=False)
    return train(options, log=lambda text: None)


def test_train_exit_writes_a_folder_with_the_adapter_and_the_sparse_head(trained, head):
    manifest = load_manifest(trained.folder)
    info = manifest.exit_adapter
    assert info is not None and info.rank == 8 and info.train_rows > 100 and info.heldout_rows > 20
    assert set(info.trained) == {"top1", "top4", "top8", "loss"}
    assert info.trained["loss"] < info.untrained["loss"]  # the target's own answers are learnable by the exit
    assert names.EXIT_SPARSE in manifest.graphs
    assert manifest.graph(names.EXIT_HEAD).validation["exit_adapter_topk_logprobs"] < 1e-3
    assert manifest.graph(names.EXIT_SPARSE).validation["exit_sparse_logits"] < 1e-3
    source = load_manifest(head[0])
    for role in (names.PREFIX, names.SUFFIX, names.DRAFT):  # the target's own graphs are untouched
        a = (head[0] / source.graph(role).file).read_bytes()
        assert a == (trained.folder / manifest.graph(role).file).read_bytes()


def test_schema_accepts_a_trained_folder(trained):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parent.parent / "docs" / "manifest.schema.json").read_text())
    jsonschema.validate(json.loads((trained.folder / names.MANIFEST_FILE).read_text()), schema)


@pytest.mark.parametrize("budget", ["time", "cap"])
def test_sd_and_mirror_with_the_trained_sparse_exit_equal_ar(budget, trained, pipelines):
    pipe = pipelines(trained.folder)
    assert pipe.target.exit_sparse is not None
    sparse_runs = 0
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=32))
        for mode in ("sd", "mirror"):
            before = len(pipe.sessions[names.EXIT_SPARSE].timeline.intervals)
            out = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=32, gamma=3, branches=4,
                                                         branch_budget=budget))
            assert out.tokens == ar.tokens, (mode, prompt)
            sparse_runs += sum(1 for s, e in pipe.sessions[names.EXIT_SPARSE].timeline.intervals[before:])
    assert sparse_runs > 0  # mirror ran the sparse exit head


def test_the_trained_full_exit_head_keeps_mirror_equal_to_ar(trained, tmp_path):
    """The same folder without exit_sparse: mirror reads the trained full exit head."""
    import shutil

    from mirrorsd.runtime import Pipeline

    folder = tmp_path / "full"
    shutil.copytree(trained.folder, folder, ignore=shutil.ignore_patterns("exit_training", "exit_sparse.onnx"))
    data = json.loads((folder / names.MANIFEST_FILE).read_text())
    del data["graphs"][names.EXIT_SPARSE]
    (folder / names.MANIFEST_FILE).write_text(json.dumps(data))
    with Pipeline.load(folder) as pipe:
        assert pipe.target.exit_sparse is None
        for prompt in PROMPTS:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=32))
            out = pipe.generate(prompt, GenerationConfig(mode="mirror", max_new_tokens=32, gamma=3,
                                                         branch_budget="cap"))
            assert out.tokens == ar.tokens


def test_a_sparse_exit_reweights_the_drafts_candidates():
    """Product of experts: a flat exit changes nothing, a peaked one moves the draft's mass at a depth to its choice
    (the depth weights stay the acceptance model's)."""
    window = np.array([6, 7])
    draft_ids = np.array([[6, 5, 4], [7, 9, 8], [3, 4, 2]])
    draft_lps = np.log(np.array([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.7, 0.2, 0.05]]))
    alone = rank_branches(window, draft_ids, draft_lps)
    flat_ids, flat_lps = candidate_logprobs(exit_candidates(draft_ids[:2], 3), np.zeros((3, 3), np.float32))
    flat = rank_branches(window, draft_ids, draft_lps, flat_ids, flat_lps)
    assert [(b.depth, b.token) for b in flat] == [(b.depth, b.token) for b in alone]
    np.testing.assert_allclose([b.score for b in flat], [b.score for b in alone])
    peaked_ids, peaked_lps = candidate_logprobs(exit_candidates(draft_ids[:2], 3),
                                                np.array([[0.0, 0.0, 5.0], [0, 0, 0], [0, 0, 0]], np.float32))
    peaked = rank_branches(window, draft_ids, draft_lps, peaked_ids, peaked_lps)
    order = lambda ranked: [(b.depth, b.token) for b in ranked if b.depth == 1]  # noqa: E731
    assert order(alone) == [(1, 5), (1, 4)]
    assert order(peaked) == [(1, 4), (1, 5)]  # the exit says: if 6 is rejected at depth 1, the target says 4


def test_exit_sweep_command_writes_what_export_reads(tmp_path, tiny_model, capsys):
    """mirrorsd-exit-sweep on a tiny model: the table, and a --json that mirrorsd-export --exit-hits accepts."""
    from mirrorsd.export.early_exit import sweep
    from mirrorsd.export.streaming.data import Sample, save_samples
    from mirrorsd.runtime.planner.exit_layer import read_hits
    from tiny_models import VOCAB

    rng = np.random.default_rng(0)
    answers = tmp_path / "exit_training"
    answers.mkdir()
    for kind, count in (("train", 6), ("eval", 3)):
        save_samples(answers / f"distill-{kind}-8.jsonl",
                     [Sample(f"{kind}{i}", rng.integers(3, VOCAB, 5).tolist(), rng.integers(3, VOCAB, 8).tolist())
                      for i in range(count)])
    out = tmp_path / "sweep.json"
    model = tiny_model("llama", layers=4)
    argv = [str(model), str(answers), "--layers", "1,2,3", "--rank", "4", "--epochs", "1", "--threads", "1",
            "--json", str(out)]
    assert sweep.main(argv) == 0
    assert "| 2 | 0.50 |" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["layers"] == 4 and record["rows"] == [48, 24] and [r["layer"] for r in record["results"]] == [1, 2, 3]
    hits, swept = read_hits(record, 4, "trained")
    assert swept == 4 and set(hits) == {1, 2, 3} and all(0 <= h <= 1 for h in hits.values())
    assert sweep.main([str(model), str(tmp_path), "--json", str(tmp_path / "never.json")]) == 2  # no answers there
    assert "distill-train" in capsys.readouterr().err and not (tmp_path / "never.json").exists()
    assert sweep.main([str(model), str(answers), "--layers", "4"]) == 2  # past the last layer
    assert "out of range" in capsys.readouterr().err
