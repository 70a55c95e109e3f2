"""A prompt chunk scores its last row only (devices/kernels/logits_rows.py): the rewrite on a real int4 export, the
rewritten graph's logits against the exported graph's bit for bit (every row at logits_from 0, the last row alone at
S - 1), and the pipeline: the draft and the target's suffix take the input where mirrorsd's kernels run them, a
prompt read in several chunks gives the first token's logits of the graphs as exported bit for bit, and every mode
gives ar's tokens.

What runs here: ONNX Runtime's CPU provider with mirrorsd's kernels library on this CPU's path. The rewrite applies
nowhere else (ONNX Runtime's own kernel, CUDA, DirectML, OpenVINO and the C/C++ host keep the exported graphs)."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_exports import kernels_or_skip, tiny_qwen_export

from mirrorsd.devices import kernels
from mirrorsd.devices.kernels.logits_rows import LOGITS_FROM, logits_from_input
from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.runtime import GenerationConfig, Pipeline

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
PROMPTS = [[1, 17, 42, 99, 7, 3, 3, 250, 12, 8, 17], [5, 6, 7, 5, 6, 7, 5, 6], list(range(2, 60, 3))]


@pytest.fixture(scope="module")
def lib():
    return kernels_or_skip()


def tiny_export(tmp_path_factory, precision: str):
    return tiny_qwen_export(tmp_path_factory, "rows", precision)


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    return tiny_export(tmp_path_factory, "int4")


def session(model: bytes):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 2
    kernels.register(opts, replace=True, allow_slow=True)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def feeds_for(sess, rows: int) -> dict:
    rng = np.random.default_rng(3)
    feeds = {}
    for spec in sess.get_inputs():
        if spec.name == LOGITS_FROM:
            continue
        if spec.name == "input_ids":
            feeds[spec.name] = rng.integers(3, 200, (1, rows)).astype(np.int64)
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones((1, rows), np.int64)
        elif spec.name == "position_ids":
            feeds[spec.name] = np.arange(rows, dtype=np.int64)[None]
        elif spec.name == "hidden_states":
            feeds[spec.name] = rng.standard_normal((1, rows, spec.shape[-1])).astype(np.float32)
        else:  # an empty past
            feeds[spec.name] = np.zeros((1, spec.shape[1], 0, spec.shape[3]), np.float32)
    return feeds


def test_the_rewrite_cuts_the_heads_rows_to_the_same_bits(lib, int4_export):
    for graph in ("draft", "suffix"):
        original = (int4_export / f"{graph}.onnx").read_bytes()
        rewritten, changed = logits_from_input(original, "logits")
        assert changed, graph
        model = onnx.load_from_string(rewritten)
        onnx.checker.check_model(model)
        assert LOGITS_FROM in [i.name for i in model.graph.input]
        assert logits_from_input(rewritten, "logits") == (rewritten, False)  # once is enough
        before, after = session(original), session(rewritten)
        feeds = feeds_for(before, 7)
        every_row = before.run(["logits"], feeds)[0]  # [1, 7, vocab]
        for first in (0, 3, 6):
            cut = after.run(["logits"], {**feeds, LOGITS_FROM: np.array([first], np.int64)})[0]
            assert cut.shape == (1, 7 - first, every_row.shape[2])
            assert np.array_equal(cut, every_row[:, first:]), (graph, first)


def test_graphs_whose_logits_are_not_one_matmulnbits_or_are_read_inside_are_left_alone(lib, int4_export,
                                                                                      tmp_path_factory):
    original = (int4_export / "draft.onnx").read_bytes()
    model = onnx.load_from_string(original)
    model.graph.node.append(onnx.helper.make_node("Identity", ["logits"], ["logits_again"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("logits_again", onnx.TensorProto.FLOAT, None))
    read_inside = model.SerializeToString()  # a node reads every row's logits: cutting rows would change it
    assert logits_from_input(read_inside, "logits") == (read_inside, False)
    assert logits_from_input(original, "no_such_output") == (original, False)
    float_export = tiny_export(tmp_path_factory, "fp32")  # its head is a MatMul
    original = (float_export / "draft.onnx").read_bytes()
    assert logits_from_input(original, "logits") == (original, False)
    with Pipeline.load(float_export, DeviceRequest(kernels="mirrorsd")) as pipe:
        assert not pipe.target.suffix.logits_from and not pipe.draft.session.logits_from
        assert pipe.generate(PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=6)).tokens


def logits_rows_of(graph) -> list[tuple[int, int]]:
    """Record (rows fed, logits rows returned) of every call of ``graph`` (a GraphSession) from now on."""
    calls, run = [], graph.run

    def recorded(feeds):
        out = run(feeds)
        calls.append((feeds[graph.first_input].shape[1], out[graph.output_names[0]].shape[1]))
        return out

    graph.run = recorded
    return calls


def test_the_pipeline_scores_a_prompts_last_row_only_and_every_mode_gives_ars_tokens(lib, int4_export):
    first_logits, runs, stats = {}, {}, {}
    for last_row in (True, False):
        with Pipeline.load(int4_export, DeviceRequest(kernels="mirrorsd", prompt_last_row_only=last_row)) as pipe:
            assert pipe.target.suffix.logits_from == last_row and pipe.draft.session.logits_from == last_row
            assert not pipe.target.prefix.logits_from and not pipe.target.exit_head.logits_from
            suffix_calls, draft_calls = logits_rows_of(pipe.target.suffix), logits_rows_of(pipe.draft.session)
            for i, prompt in enumerate(PROMPTS):
                pipe.target.reset(1, 64)
                suffix_calls.clear()
                first_logits[last_row, i] = pipe.target.prefill(prompt, chunk=4)  # several chunks, the last short
                assert len(suffix_calls) == -(-len(prompt) // 4)
                assert all(got == (1 if last_row else fed) for fed, got in suffix_calls), suffix_calls
                pipe.draft.reset()
                draft_calls.clear()
                pipe.draft.prefill(prompt, chunk=4)
                assert all(got == (1 if last_row else fed) for fed, got in draft_calls), draft_calls
                assert pipe.draft.cache.length == len(prompt) and pipe.draft.cache_tokens == prompt
                next_logits = pipe.draft.extend([prompt[-1]])  # one row after the prompt: scored as usual
                assert next_logits.shape[0] == 1
                first_logits[last_row, i, "draft"] = next_logits
                for mode in ("ar", "sd", "mirror", "ngram"):
                    pipe.draft.reset()  # (else the draft keeps the prompt read above: nothing left to read)
                    draft_calls.clear()
                    result = pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=16))
                    runs[last_row, i, mode] = result.tokens
                    stats[last_row, i, mode] = (result.stats.steps, result.stats.accepted)
                    if mode == "sd" and last_row:  # a rollout's first forward reads the prompt: its last row scored
                        fed, got = draft_calls[0]
                        assert fed > 1 and got == 1, draft_calls[:3]
    for i in range(len(PROMPTS)):
        assert first_logits[True, i].shape == first_logits[False, i].shape == (1, first_logits[True, i].shape[1])
        assert np.array_equal(first_logits[True, i], first_logits[False, i]), i
        assert np.array_equal(first_logits[True, i, "draft"], first_logits[False, i, "draft"]), i
        for mode in ("ar", "sd", "mirror", "ngram"):
            assert runs[True, i, mode] == runs[False, i, "ar"], (i, mode)
            assert stats[True, i, mode] == stats[False, i, mode], (i, mode)  # the draft proposed the same windows
