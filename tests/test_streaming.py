"""Speculative Streaming drafts: training, the draft_streaming graph, and decoding with it.

Two streaming drafts, both trained here in seconds:
  cyclic  a tiny target trained until its greedy answers cycle through five tokens, and a draft of it whose streams
          learn that cycle: real text is predictable too, and here the lookahead must pay off (fewer forwards)
  weak    streams on a random tiny draft, trained three steps to distil a random target: almost nothing holds,
          and the output must still be the target's own
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mirrorsd.errors import ModelSourceError, OutputFolderError
from mirrorsd.runtime import GenerationConfig
from tiny_models import write_questions

CYCLE = [100, 140, 180, 220, 260]
PROMPTS = [[1, 17, 42, 99, 7], [1, 250, 3, 3, 3, 100, 200, 12, 8, 60, 61, 62], [1, 300, 2], list(range(20, 60))]
NEW = 32


def build_cyclic_target(folder: Path, steps: int = 100, seed: int = 5) -> Path:
    """A tiny llama trained until its greedy continuation of any prompt is CYCLE repeated (large margins)."""
    import transformers

    from tiny_models import build_model

    build_model(folder, "llama", layers=4, seed=seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and far faster on a busy machine
    gen = torch.Generator().manual_seed(seed)
    others = torch.tensor([t for t in range(1, 384) if t not in CYCLE])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = []
        for _ in range(16):
            prefix = others[torch.randint(len(others), (int(torch.randint(1, 20, (1,), generator=gen)),),
                                          generator=gen)]
            if torch.rand(1, generator=gen) < 0.3:  # some prompts end inside the cycle: it continues from there
                prefix[-1] = CYCLE[int(torch.randint(len(CYCLE), (1,), generator=gen))]
            start = CYCLE.index(int(prefix[-1])) + 1 if int(prefix[-1]) in CYCLE else 0
            rows.append(torch.cat([prefix, torch.tensor([CYCLE[(start + i) % 5] for i in range(40 - len(prefix))])]))
        ids = torch.stack(rows)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    return write_questions(tmp_path_factory.mktemp("questions"), 36)


def train_options(draft, target, output, questions, **kw):
    from mirrorsd.export.streaming.train import TrainOptions

    base = dict(draft=draft, target=target, output=output, prompts=questions, streams=3, stream_layers=2,
                train_prompts=12, eval_prompts=3, holdout=3, max_new_tokens=24, max_steps=40, lr=5e-3, anchors=16,
                save_every=0, threads=1, progress=False)
    base.update(kw)
    return TrainOptions(**base)


@pytest.fixture(scope="module")
def cyclic(tmp_path_factory, questions):
    from mirrorsd.export.streaming.train import train

    target = build_cyclic_target(tmp_path_factory.mktemp("cyclic") / "target")
    result = train(train_options(target, target, tmp_path_factory.mktemp("cyclic-ss") / "draft", questions))
    return target, result


@pytest.fixture(scope="module")
def weak(tmp_path_factory, tiny_model, questions):
    from mirrorsd.export.streaming.train import train

    target = tiny_model("llama")
    result = train(train_options(tiny_model("llama", layers=2, seed=7), target,
                                 tmp_path_factory.mktemp("weak-ss") / "draft", questions, max_steps=3))
    return target, result


@pytest.fixture(scope="module")
def folders(tmp_path_factory, cyclic, weak):
    from mirrorsd.export.pipeline import ExportOptions, export

    out = {}
    for name, (target, result) in (("cyclic", cyclic), ("weak", weak)):
        out[name] = tmp_path_factory.mktemp(f"export-{name}") / "out"
        export(ExportOptions(model=target, draft=result.folder, output=out[name]))
    return out


def test_training_lowers_the_stream_loss(cyclic):
    evaluation = cyclic[1].config.evaluation
    before, after = evaluation["before"], evaluation["after"]
    assert after["stream_loss"] < 0.5 * before["stream_loss"]
    assert after["tokens_per_forward"] > before["tokens_per_forward"] + 1.0  # teacher-forced lookahead holds
    assert cyclic[1].config.training["steps"] == 40


def test_output_folder_is_a_streaming_draft(cyclic):
    from mirrorsd.export.streaming.model import StreamingConfig, is_streaming_draft

    folder = cyclic[1].folder
    assert is_streaming_draft(folder) and (folder / "model.safetensors").is_file()
    config = StreamingConfig.load(folder)
    assert (config.streams, config.stream_layers, config.method) == (3, 2, "lora")


def test_export_writes_and_validates_the_streaming_graph(folders):
    from mirrorsd.export.streaming.graph import CHECKS
    from mirrorsd.manifest import load_manifest

    spec = load_manifest(folders["cyclic"]).graph("draft_streaming")
    assert [t.name for t in spec.outputs[:2]] == ["logits", "stream_logits"]
    assert spec.outputs[1].shape == ("batch_size", 3, 384) and spec.kv.layers == (0, 4)
    assert set(spec.validation) == {"draft_streaming_logits", "draft_streaming_cached_logits",
                                    "draft_streaming_stream_logits"}
    assert all(v <= CHECKS[k][0] * 10 for k, v in spec.validation.items())


def test_streaming_graph_matches_module_with_holes_and_past(cyclic, folders):
    """ONNX (explicit past, a hole in the mask) vs the module's training path (no KV, same mask)."""
    import onnxruntime as ort

    from mirrorsd.export.loading import load_model
    from mirrorsd.export.streaming.graph import detect

    folder = cyclic[1].folder
    source = load_model(folder)
    module = detect(folder, source).module(source.model, source.arch)
    ids = torch.tensor([[1, 17, 42, 99, 7, 100, 140, 180], [1, 250, 3, 8, 60, 61, 62, 100]])
    mask = torch.ones_like(ids)
    mask[1, 2] = 0  # a hole, as an abandoned branch slot leaves it
    positions = torch.tensor([list(range(8)), [0, 1, 2, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        h_f = module.trunk(ids, mask, positions)
        _, streams = module.top(h_f, mask, positions, torch.full((3,), 7), torch.arange(3))
        want = module.head(streams).numpy()
        kv_names = [f"past_key_values.{i}.{kv}" for i in range(4) for kv in ("key", "value")]
        past = module(ids[:, :5], mask[:, :5], positions[:, :5], *[torch.zeros(2, 2, 0, 16)] * 8)[2:]
    session = ort.InferenceSession(str(folders["cyclic"] / "draft_streaming.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids[:, 5:].numpy(), "attention_mask": mask.numpy(), "position_ids": positions[:, 5:].numpy()}
    feeds.update({name: p.numpy() for name, p in zip(kv_names, past)})
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert np.abs(out["stream_logits"] - want).max() <= 1e-4 * (1 + np.abs(want).max())
    assert out["present.3.key"].shape[2] == 8  # past 5 + 3 new main slots: the 3 stream slots keep no KV


@pytest.mark.parametrize("kind", ["cyclic", "weak"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_sd_and_mirror_with_a_streaming_draft_equal_ar(kind, gamma, folders, pipelines):
    pipe = pipelines(folders[kind])
    assert pipe.streaming_draft is not None and pipe.streaming_draft.streams == 3
    for prompt in PROMPTS:
        ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW, gamma=gamma,
                                                         branch_budget="cap"))
            assert out.tokens == ar, (kind, mode, gamma, prompt)
            s = out.stats
            assert s.accepted <= s.drafted and s.reused + s.fallbacks == s.windows
            if mode == "sd":
                assert s.draft_forwards <= s.drafted  # never more forwards than drafted tokens


def test_trained_streams_need_fewer_draft_forwards(folders, pipelines):
    pipe = pipelines(folders["cyclic"])
    gamma = 4
    streamed = pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma))
    plain = pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=NEW, gamma=gamma, streaming=False))
    assert streamed.tokens == plain.tokens
    assert plain.stats.draft_forwards_per_window == pytest.approx(plain.stats.drafted / plain.stats.windows)
    assert streamed.stats.draft_forwards_per_window < 0.7 * gamma  # ideal with 3 streams: 2 per 4-token window
    assert streamed.stats.acceptance_rate == plain.stats.acceptance_rate


def test_streaming_rollout_matches_draft_rollout(folders, pipelines):
    from mirrorsd.runtime.rollout import fresh

    pipe = pipelines(folders["weak"])
    for committed in PROMPTS:
        pipe.draft.reset(capacity=len(committed) + 64)
        pipe.streaming_draft.reset(capacity=len(committed) + 64)
        want = fresh(pipe.draft, committed, 6, top_k=3)
        got = fresh(pipe.streaming_draft, committed, 6, top_k=3, lookahead=True)
        assert got.tokens.tolist() == want.tokens.tolist() and got.top_ids.tolist() == want.top_ids.tolist()
        assert want.forwards == 6 and 1 <= got.forwards <= 6
        assert pipe.streaming_draft.cache_tokens == committed + got.tokens[:-1].tolist()  # draft_rollout's state
        assert pipe.streaming_draft.cache.length == len(committed) + 5
        assert pipe.draft.cache_tokens == committed + want.tokens[:-1].tolist()
        assert pipe.draft.cache.length == len(committed) + 5


@pytest.mark.parametrize("kind", ["cyclic", "weak"])
def test_streamed_branch_rollouts_match_plain_ones(kind, folders, pipelines):
    """Mirror's branch rollouts with the streaming draft: per branch the same tokens and candidates as the plain
    draft's rollout (the lookahead only saves forwards), and adopting a streamed branch (its KV sits in the row
    with holes between) leaves the main cache as adopting the plain branch does."""
    from mirrorsd.runtime.rollout import adopt, branches, fresh
    from mirrorsd.runtime.sampling import GREEDY
    from mirrorsd.runtime.verify import Branch

    pipe = pipelines(folders[kind])
    g = 5
    for committed in PROMPTS:
        ready, forwards, adopted = {}, {}, {}
        for name, draft in (("plain", pipe.draft), ("streamed", pipe.streaming_draft)):
            draft.reset(capacity=len(committed) + 64)
            rollout = fresh(draft, committed, g, top_k=3)
            draft.extend([int(rollout.tokens[-1])])  # the worker's extend: main cache = committed + window
            batch = [Branch(1, int(rollout.top_ids[0, 1]), 0.0), Branch(3, int(rollout.top_ids[2, 1]), 0.0),
                     Branch(g + 1, 7, 0.0)]
            calls = []
            rows = branches(draft, committed, rollout.tokens, batch, GREEDY, 3, name == "streamed",
                            lambda: calls.append(1) and False)
            assert rows is not None and len(calls) == rows[0].forwards
            ready[name] = {(b.depth, b.token): row for b, row in zip(batch, rows)}
            forwards[name] = rows[0].forwards
            hit = ready[name][(3, batch[1].token)]  # adopt branch (3, v): keep committed + window[:2], then v ...
            now = committed + rollout.tokens[:2].tolist() + [batch[1].token]
            adopt(draft, hit, now)
            assert draft.cache.length == len(now) + g - 1 and draft.cache_tokens == now + hit.tokens[:-1].tolist()
            adopted[name] = [k[0, :, :draft.cache.length].copy() for k in draft.cache.keys]
        for key, plain in ready["plain"].items():
            streamed = ready["streamed"][key]
            assert streamed.tokens.tolist() == plain.tokens.tolist(), (kind, committed, key)
            assert streamed.top_ids.tolist() == plain.top_ids.tolist()
        assert forwards["plain"] == g and 1 <= forwards["streamed"] <= g
        for a, b in zip(adopted["plain"], adopted["streamed"]):
            assert a.shape == b.shape and np.abs(a - b).max() < 1e-4
    if kind == "cyclic":
        assert forwards["streamed"] < g  # trained streams must save forwards on the cycle


@pytest.mark.parametrize("kind", ["cyclic", "weak"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_branch_is_the_window_a_fresh_rollout_after_the_verdict_draws(kind, sampled, folders, pipelines):
    """What makes reuse lossless: branch (d, v), rolled out before the verdict in a batch with other branches,
    holds the tokens (and the q they were drawn from) of a fresh one-row rollout from committed + window[:d-1] + v,
    with and without lookahead, greedy or with keyed draws. A rollout told to stop between forwards gives nothing."""
    from mirrorsd.runtime.rollout import branches, fresh
    from mirrorsd.runtime.sampling import GREEDY, Sampler, SamplingParams
    from mirrorsd.runtime.verify import Branch

    pipe = pipelines(folders[kind])
    sampler = Sampler(SamplingParams(do_sample=True, temperature=0.9, seed=3, verify="residual")) if sampled \
        else GREEDY
    g = 4
    for committed in PROMPTS[:3]:
        for lookahead, draft in ((False, pipe.draft), (True, pipe.streaming_draft)):
            draft.reset(capacity=len(committed) + 64)
            window = fresh(draft, committed, g, sampler, 3, lookahead)
            draft.extend([int(window.tokens[-1])])
            batch = [Branch(d, int(window.top_ids[d - 1, 1]), 0.0) for d in (1, 2, 4)] + [Branch(g + 1, 9, 0.0)]
            assert branches(draft, committed, window.tokens, batch, sampler, 3, lookahead, lambda: True) is None
            rows = branches(draft, committed, window.tokens, batch, sampler, 3, lookahead)
            reference = pipe.draft  # plain, one row, from scratch
            for branch, row in zip(batch, rows):
                after = committed + window.tokens[:branch.depth - 1].tolist() + [branch.token]
                reference.reset(capacity=len(after) + 64)
                want = fresh(reference, after, g, sampler, 3)
                assert row.tokens.tolist() == want.tokens.tolist(), (kind, sampled, lookahead, branch)
                assert (row.probs is None) == (want.probs is None) == (not sampled)
                if sampled:
                    np.testing.assert_allclose(row.probs, want.probs, atol=1e-5)


def test_int4_streaming_draft_quantizes_both_heads_and_stays_lossless(folders, tmp_path):
    """The streaming graph uses the LM head twice (main and stream heads; TorchScript puts an Identity between the
    weight and the second MatMul): both heads must end up 4-bit, through export-time quantization and through
    `mirrorsd quantize` alike, and sd/mirror with that draft must still equal ar."""
    import onnx

    from mirrorsd.export.requantize import requantize
    from mirrorsd.runtime import Pipeline

    out = requantize(folders["cyclic"], tmp_path / "q", "fp32", "int4")
    model = onnx.load(str(out / "draft_streaming.onnx"), load_external_data=False)
    matmul_weights = {i for n in model.graph.node if n.op_type == "MatMul" for i in n.input}
    fp32_weights = [i.name for i in model.graph.initializer if i.name in matmul_weights and len(i.dims) == 2]
    assert fp32_weights == [], fp32_weights  # every weight MatMul became MatMulNBits
    assert not any(n.op_type == "Identity" and n.input[0] in {i.name for i in model.graph.initializer}
                   for n in model.graph.node)
    with Pipeline.load(out) as pipe:
        assert pipe.streaming_draft is not None
        for prompt in PROMPTS[:2]:
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=NEW)).tokens
            for mode in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=NEW)).tokens == ar


def test_resume_continues_exactly(tmp_path, weak, questions):
    from safetensors.torch import load_file

    from mirrorsd.export.streaming.train import train

    target, draft = weak[0], weak[1].config.base_model
    straight = train(train_options(draft, target, tmp_path / "straight", questions, max_steps=4))
    first = train(train_options(draft, target, tmp_path / "split", questions, max_steps=2))
    resumed = train(train_options(draft, target, tmp_path / "split", questions, max_steps=4, resume=True))
    assert first.steps == 2 and resumed.steps == 4 and len(resumed.losses) == 2
    assert resumed.losses == pytest.approx(straight.losses[2:], rel=1e-5)
    a, b = (load_file(str(r.folder / "streams.safetensors"))["stream_embeddings"] for r in (straight, resumed))
    assert torch.allclose(a, b, atol=1e-6)


def test_trainer_refuses_to_overwrite_or_resume_nothing(tmp_path, weak, questions):
    from mirrorsd.export.streaming.train import train

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "note.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="not empty"):
        train(train_options(weak[0], weak[0], tmp_path / "busy", questions))
    with pytest.raises(OutputFolderError, match="Nothing to resume"):
        train(train_options(weak[0], weak[0], tmp_path / "fresh", questions, resume=True))


def test_export_rejects_stream_embeddings_of_another_model(tmp_path, cyclic):
    import shutil

    from safetensors.torch import save_file

    from mirrorsd.export.pipeline import ExportOptions, export

    broken = tmp_path / "broken"
    shutil.copytree(cyclic[1].folder, broken, ignore=shutil.ignore_patterns("train_state", "distill*"))
    save_file({"stream_embeddings": torch.zeros(3, 32)}, str(broken / "streams.safetensors"))
    with pytest.raises(ModelSourceError, match="do not fit"):
        export(ExportOptions(model=cyclic[0], draft=broken, output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_answers_from_an_export_folder_equal_the_pytorch_targets(tmp_path, weak, folders, questions):
    """--target EXPORT runs the target with ONNX Runtime: same greedy answers (large margins here)."""
    from mirrorsd.export.streaming import data
    from mirrorsd.export.streaming.train import train

    draft = weak[1].config.base_model
    train(train_options(draft, folders["weak"], tmp_path / "ort", questions, max_steps=1))
    by_ort = data.load_samples(tmp_path / "ort" / "distill-train.jsonl")
    by_torch = data.load_samples(weak[1].folder / "distill-train.jsonl")
    assert [s.tokens for s in by_ort] == [s.tokens for s in by_torch] and len(by_ort) == 12


@pytest.mark.parametrize("kind", ["cyclic", "weak"])
def test_sampling_and_penalties_with_a_streaming_draft(kind, folders, pipelines):
    """Streaming windows are the draft's own keyed draws (sampling.py): the exact rule still emits ar's tokens,
    the residual rule the plain draft's, and greedy with a repetition penalty stays lossless."""
    pipe = pipelines(folders[kind])
    for seed in range(2):
        kw = dict(max_new_tokens=24, gamma=4, do_sample=True, temperature=0.9, top_k=0, top_p=1.0, seed=seed)
        ar = pipe.generate(PROMPTS[0], GenerationConfig(mode="ar", **kw)).tokens
        for mode in ("sd", "mirror"):
            assert pipe.generate(PROMPTS[0], GenerationConfig(mode=mode, **kw)).tokens == ar, (mode, seed)
        streamed = pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", verify="residual", **kw)).tokens
        plain = pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", verify="residual", streaming=False, **kw))
        assert streamed == plain.tokens
    kw = dict(max_new_tokens=24, gamma=4, repetition_penalty=1.3, do_sample=False)
    ar = pipe.generate(PROMPTS[1], GenerationConfig(mode="ar", **kw)).tokens
    for mode in ("sd", "mirror"):
        assert pipe.generate(PROMPTS[1], GenerationConfig(mode=mode, **kw)).tokens == ar
