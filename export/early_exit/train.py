"""``mirrorsd-train-exit``: fit the exit adapter on an export's own target and write a new export folder.

    1. copy       every file of --model into a scratch folder beside --output (mirrorsd/output_folder.py: the same
                  rules as an export; published by rename only when everything below passed) except exit_head.onnx
                  and mirrorsd.json
    2. data       the target's greedy answers to SpecBench training / held-out questions (features.py), cached in
                  OUTPUT/exit_training/ (a --force re-run into the same --output starts from that cache)
    3. features   one target pass per answer: x = the exit head's LM-head input at the exit layer, label = the
                  target's greedy token; W, b = the exit head's own LM head (graph.head_weight)
    4. fit        adapter.fit: cross-entropy on the training rows; hit rates on the held-out rows before and after
    5. write      exit_head.onnx with the adapter (graph.with_adapter), exit_sparse.onnx (graph.sparse_head), each
                  checked against the PyTorch module on held-out rows; the manifest records the hit rates
The target's prefix, suffix and draft graphs are copied untouched: the target's tokens cannot change.
"""
from __future__ import annotations

import importlib
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mirrorsd import names
from mirrorsd.errors import ValidationError
from mirrorsd.export.early_exit.options import ExitTrainOptions
from mirrorsd.manifest import ExitAdapterInfo, GraphSpec, Manifest, TensorSpec, load_manifest

DATA_DIR = "exit_training"
SPARSE_ROWS = np.float16  # a quantized target's LM-head rows in the sparse head (fp32 targets keep fp32)
CHECK_TOLERANCE = 1e-3  # |graph - PyTorch| on log-probs / logits (float32 sums in another order)
# A quantized exit head quantizes its activations to int8 (MatMulNBits accuracy level 4) where PyTorch multiplies
# in fp32 by the same dequantized weights; fp16 rows in the sparse head round the weights: both far above float noise.
QUANTIZED_TOLERANCE = 0.25


@dataclass(frozen=True)
class ExitTrainResult:
    folder: Path
    manifest: Manifest
    info: ExitAdapterInfo


def train(options: ExitTrainOptions, log=print) -> ExitTrainResult:
    """Train the exit of ``options.model`` into a new export folder ``options.output`` (see the module doc)."""
    from mirrorsd import ranges
    from mirrorsd.errors import ExportOptionError, ManifestError
    from mirrorsd.export.early_exit.options import limits
    from mirrorsd.output_folder import EXPORT, StagedFolder, check_output
    from mirrorsd.user_files import resolved

    ranges.check(options, limits(), ExportOptionError)  # every number first: nothing is read before
    source = resolved(options.model, "--model", ManifestError)
    manifest = load_manifest(source)
    if options.rank > manifest.target.hidden_size:
        raise ExportOptionError(f"--rank {options.rank} is out of range",
                                f"the adapter's rank is at most the target's hidden size ({manifest.target.hidden_size})",
                                "pass a smaller --rank (default 64)")
    output = check_output(options.output, [source], options.force, EXPORT)
    for heavy in ("onnx", "onnxruntime", "torch"):  # before the staged folder exists: a SIGTERM during their native
        importlib.import_module(heavy)  # initialisation could crash the interpreter and leave the folder behind
    with StagedFolder(output) as stage:
        result = _train_into(stage.path, source, manifest, options, output, log)
        stage.publish()
    return replace(result, folder=output)


def _train_into(stage: Path, source: Path, manifest: Manifest, options: ExitTrainOptions, output: Path,
                log) -> ExitTrainResult:
    import onnx
    import onnxruntime as ort
    import torch

    from mirrorsd import specbench
    from mirrorsd.export.early_exit import features, graph
    from mirrorsd.export.early_exit.adapter import FitOptions, fit
    from mirrorsd.export.streaming.data import ExportTarget, pick

    if options.threads:
        torch.set_num_threads(options.threads)
    exit_spec = manifest.graph(names.EXIT_HEAD)
    head_model = onnx.load(str(source / exit_spec.file))
    weight, bias = graph.head_weight(head_model, manifest.target.hidden_size)
    trunk = ort.InferenceSession(graph.trunk(head_model).SerializeToString(), providers=["CPUExecutionProvider"])

    questions = specbench.read(options.prompts, "--prompts")
    train_q, held_q = specbench.held_out(questions, options.holdout)
    train_q, held_q = pick(train_q, options.train_prompts, options.seed), pick(held_q, options.eval_prompts, options.seed)
    _copy_source(source, stage, previous=output)  # after every input was read: a bad one fails before the copy
    data = stage / DATA_DIR
    data.mkdir(exist_ok=True)
    chat = bool(manifest.tokenizer.chat_template)
    if not chat:
        log("the target has no chat template: its prompts are raw completion (as mirrorsd bench runs them)")
    target = ExportTarget(source, options.max_new_tokens, options.threads)
    try:
        sets = {}
        for name, qs in (("train", train_q), ("eval", held_q)):
            started = time.perf_counter()
            samples = features.distill(target, target.tokenizer, qs, options.max_prompt_tokens,
                                       options.generation_batch, data / f"distill-{name}-{options.max_new_tokens}.jsonl",
                                       chat=chat)
            log(f"target answers ({name}): {len(samples)} questions ({time.perf_counter() - started:.0f} s)")
            started = time.perf_counter()
            sets[name] = features.rows(target.pipe, trunk, samples,
                                       prompt_rows=options.prompt_rows if name == "train" else 0)
            log(f"  {len(sets[name].labels)} rows ({time.perf_counter() - started:.0f} s)")
    finally:
        target.close()
    w, b = torch.from_numpy(weight), (torch.from_numpy(bias) if np.any(bias) else None)
    fit_options = FitOptions(rank=options.rank, epochs=options.epochs, batch=options.batch, lr=options.lr,
                             seed=options.seed, max_minutes=options.max_minutes)
    result = fit(sets["train"].x, sets["train"].labels, sets["eval"].x, sets["eval"].labels, w, b, fit_options, log)
    down, up = (p.detach().numpy() for p in (result.adapter.down, result.adapter.up))
    adapted = graph.with_adapter(head_model, down, up)
    graphs = dict(manifest.graphs)
    fp32 = manifest.export_options.get("target_precision", "fp32") == "fp32"
    tolerance = CHECK_TOLERANCE if fp32 else QUANTIZED_TOLERANCE
    graphs[names.EXIT_HEAD] = replace(exit_spec, validation={
        **exit_spec.validation, "exit_adapter_topk_logprobs": _check_adapted(adapted, result.adapter, sets["eval"],
                                                                             w, b, manifest.top_k, tolerance)})
    onnx.save(adapted, str(stage / exit_spec.file))
    if options.sparse:
        rows_dtype = np.float32 if fp32 else SPARSE_ROWS
        sparse = graph.sparse_head(adapted, weight, bias, rows_dtype)
        spec = _sparse_spec(manifest)
        graphs[names.EXIT_SPARSE] = replace(spec, validation={"exit_sparse_logits": _check_sparse(
            sparse, result.adapter, sets["eval"], w, b, tolerance)})
        onnx.save(sparse, str(stage / spec.file))
    info = ExitAdapterInfo(options.rank, len(sets["train"].labels), result.after.rows, _scores(result.before),
                           _scores(result.after), len(result.history), round(result.seconds, 1))
    new = replace(manifest, graphs=graphs, exit_adapter=info)
    new.save(stage)
    load_manifest(stage)  # what the runtime will read back
    return ExitTrainResult(stage, new, info)


def _copy_source(source: Path, stage: Path, previous: Path) -> None:
    """Every file of the source export except its manifest and exit head (rewritten here) and its own training data;
    the target answers cached by an earlier run into the same output (``previous``, replaced with --force) come
    along, so a re-run does not generate them again."""
    for path in source.rglob("*"):
        rel = path.relative_to(source)
        if path.is_dir() or rel.parts[0] == DATA_DIR or str(rel) in (names.MANIFEST_FILE,
                                                                    names.graph_file(names.EXIT_HEAD)):
            continue
        dest = stage / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    cached = previous / DATA_DIR
    if cached.is_dir() and not cached.is_symlink():
        shutil.copytree(cached, stage / DATA_DIR, symlinks=True)


def _sparse_spec(manifest: Manifest) -> GraphSpec:
    exit_spec = manifest.graph(names.EXIT_HEAD)
    shape = (names.BATCH, names.SEQUENCE, "candidates")
    return GraphSpec(names.EXIT_SPARSE, names.graph_file(names.EXIT_SPARSE), "target",
                     (exit_spec.inputs[0], TensorSpec(names.CANDIDATE_IDS, "int64", shape)),
                     (TensorSpec(names.CANDIDATE_LOGITS, "float32", shape),), exit_spec.layer_range)


def _check_adapted(model, adapter, rows, w, b, top_k: int, tolerance: float) -> float:
    """Max |graph - PyTorch| of the adapted exit head's top-k log-probs on held-out h(L) rows."""
    import onnxruntime as ort
    import torch

    from mirrorsd.export.early_exit.adapter import head_logits

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run([names.TOPK_LOGPROBS], {session.get_inputs()[0].name: rows.hidden[None]})[0][0]
    with torch.no_grad():
        logits = head_logits(adapter(torch.from_numpy(rows.hidden_x)), w, b)
        want = torch.topk(torch.log_softmax(logits, -1), top_k, -1).values.numpy()
    return _within(got, want, "exit_adapter_topk_logprobs", tolerance)


def _check_sparse(model, adapter, rows, w, b, tolerance: float) -> float:
    """Max |sparse graph - PyTorch logits at the same ids| on held-out rows, 16 random candidates each."""
    import onnxruntime as ort
    import torch

    from mirrorsd.export.early_exit.adapter import head_logits

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, w.shape[1], (1, len(rows.hidden), 16), dtype=np.int64)
    got = session.run(None, {session.get_inputs()[0].name: rows.hidden[None], names.CANDIDATE_IDS: ids})[0][0]
    x = rows.hidden_x
    with torch.no_grad():
        full = head_logits(adapter(torch.from_numpy(x)), w, b).numpy()
    want = np.take_along_axis(full, ids[0], -1)
    scale = max(1.0, float(np.abs(want).max()))
    return _within(got, want, "exit_sparse_logits", tolerance * scale)


def _within(got, want, check: str, tolerance: float = CHECK_TOLERANCE) -> float:
    diff = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max()) if np.size(got) else 0.0
    if not diff <= tolerance:
        raise ValidationError(f"The trained exit head differs from PyTorch ({check})",
                                    f"max |difference| {diff:.3g} > {tolerance:g}",
                                    "this is a bug in mirrorsd-train-exit; please report it")
    return diff


def _scores(scores) -> dict[str, float]:
    return {**{f"top{k}": round(v, 4) for k, v in scores.hit.items()}, "loss": round(scores.loss, 4)}
