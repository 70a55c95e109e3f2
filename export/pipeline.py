"""The export as one typed function: open the models, write every graph, validate, write the manifest, publish.

Graphs are built layer by layer from the checkpoint (build.py, assembly.py), so memory stays near one graph's
largest layer plus the ONNX Runtime session that validates it, not the model. The folder appears under its final
name only when every graph validated (mirrorsd/output_folder.py); on any error, Ctrl-C included, the scratch folder is removed and
an existing output folder is left as it was. With ``resume`` the scratch folder is kept instead, and the next
``resume`` run continues from the graphs it holds.
"""
from __future__ import annotations

import dataclasses
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from mirrorsd import names
from mirrorsd.errors import ExportOptionError
from mirrorsd.manifest import SCHEMA_VERSION, GraphSpec, Manifest, TokenizerInfo, VocabSubsetInfo
from mirrorsd.export.graphs import draft as draft_graph, draft_static, exit_head, prefix, suffix
from mirrorsd.export.graphs import attention
from mirrorsd.export.options import DEFAULT_TOP_K, ExportOptions
from mirrorsd.export.gguf_blocks import check_mode
from mirrorsd.export.quantize import check_precision
from mirrorsd.export.streaming import graph as streaming_graph
from mirrorsd.export import embedding, vocab_subset
from mirrorsd.output_folder import EXPORT, StagedFolder, check_output

TARGET_GRAPHS = (prefix, exit_head, suffix)  # graph modules (graphs/base.py), in validation order
DRAFT_GRAPHS = (draft_graph,)
RUN_ONLY = ("output", "force", "resume", "whole_graphs")  # options that do not change the folder's content


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    manifest: Manifest
    seconds: float


def export(options: ExportOptions, progress: Callable[[str], None] = lambda step: None,
           on_layer: Callable[[str, int, int], None] = lambda role, done, total: None) -> ExportResult:
    """Export ``options.model`` (and its draft); ``progress`` gets each step, ``on_layer`` each written layer."""
    from mirrorsd.export.loading import open_model, source_path
    from mirrorsd.export.source_checks import check_same_vocabulary

    started = time.perf_counter()
    sources = [source_path(p) for p in (options.model, options.draft) if p is not None]
    output = check_output(options.output, sources, options.force, EXPORT)
    stage = StagedFolder(output, resumable=options.resume)
    _check_static_options(options)
    vocab_subset.check_size(options.draft_vocab)
    _check_max_context(options, None)
    check_precision(options.target_precision, "--target-precision")
    check_precision(options.draft_precision, "--draft-precision")
    check_mode(options.gguf_blocks)
    check_mode(options.draft_gguf_blocks or options.gguf_blocks)
    embedding.check_mode(options.embedding)
    check_storage(options)
    _check_fp16(options, None)
    if options.exit_layer is None and options.exit_hits is not None and options.exit_profile is not None:
        from mirrorsd.export.exit_choice import read_inputs

        read_inputs(options.exit_hits, options.exit_profile)  # bad files fail now, not after the model opens
    progress("opening target")
    target = open_model(options.model, options.trust_remote_code)
    draft = _open_draft(options, target, progress)
    check_same_vocabulary(target, draft)
    streaming = streaming_graph.detect(options.draft, draft)  # a mirrorsd-train-draft folder: + draft_streaming
    _check_fp16(options, streaming)
    _check_draft_vocab(options, streaming)
    vocab_subset.check_size(options.draft_vocab, draft.info.vocab_size)
    exit_layer, exit_choice = _exit_layer(options, target.info.num_layers, progress)
    _check_max_context(options, draft.info.max_position_embeddings)
    if not 1 <= options.top_k <= target.info.vocab_size:
        raise ExportOptionError(f"--top-k {options.top_k} is out of range", f"it must be 1..{target.info.vocab_size}",
                                f"use the default {DEFAULT_TOP_K}")
    with stage:
        manifest = _write_folder(stage.path, options, target, draft, exit_layer, progress, on_layer, streaming,
                                 exit_choice)
        stage.publish()
    return ExportResult(output, manifest, time.perf_counter() - started)


def _write_folder(scratch: Path, options: ExportOptions, target, draft, exit_layer: int, progress, on_layer,
                  streaming=None, exit_choice: dict | None = None) -> Manifest:
    from mirrorsd.export.build import ModelJob, run_job
    from mirrorsd.export.genai_config import write_genai_config
    from mirrorsd.export.resume import open_state

    state = open_state(scratch, _fingerprint(options, target, draft))
    optional = _optional_graphs(options, draft) + ((streaming,) if streaming else ())
    jobs = (ModelJob("target", target, TARGET_GRAPHS, options.target_precision, exit_layer, options.top_k,
                     options.whole_graphs, options.gguf_blocks, options.embedding, options.weight_storage),
            ModelJob("draft", draft, DRAFT_GRAPHS + optional, options.draft_precision, exit_layer, options.top_k,
                     options.whole_graphs, options.draft_gguf_blocks or options.gguf_blocks, options.embedding,
                     draft_storage(options)))
    graphs = {}
    for job in jobs:
        for role, (module, build, validation) in run_job(job, scratch, state, progress, on_layer).items():
            io = build.io
            graphs[role] = GraphSpec(role, names.graph_file(role), module.MODEL, io.inputs, io.outputs,
                                     build.layer_range, io.kv, validation, dict(build.static_shapes))
    subset = _restrict_draft_vocab(scratch, options, target, draft, graphs, state, progress)
    progress("writing tokenizer and manifest")
    tokenizer = _save_tokenizer(target, scratch)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, target=target.info, draft=draft.info, exit_layer=exit_layer,
        top_k=options.top_k, graphs=graphs, tokenizer=tokenizer, generation_defaults=_generation_defaults(target),
        export_options={**_recorded_options(options), **({"exit_layer_choice": exit_choice} if exit_choice else {})},
        versions=_versions(), attention=attention.KIND, draft_vocab_subset=subset)
    manifest.save(scratch)
    write_genai_config(scratch, manifest)  # the target as an onnxruntime-genai decoder-pipeline model
    state.remove()
    return manifest


def _restrict_draft_vocab(scratch: Path, options: ExportOptions, target, draft, graphs: dict, state,
                          progress) -> VocabSubsetInfo | None:
    """--draft-vocab N: cut the validated draft graph's LM head to the N ids (export/vocab_subset.py), in place."""
    n = options.draft_vocab
    if n is None:
        return None
    spec, file = graphs[names.DRAFT], scratch / names.graph_file(names.DRAFT)
    if not vocab_subset.is_restricted(file):  # a resumed export may hold the cut file, and its check, already
        progress(f"cutting the draft's LM head to {n} of {draft.info.vocab_size} ids")
        ids = vocab_subset.subset_ids(target.tokenizer, draft.info.vocab_size, n)
        diff = vocab_subset.restrict_file(file, ids, draft.info.vocab_size, spec.kv)
        validated = {role: dict(g.validation) for role, g in graphs.items() if g.model == "draft"}
        validated[names.DRAFT][vocab_subset.CHECK] = diff
        state.record("draft", validated)
        graphs[names.DRAFT] = dataclasses.replace(spec, validation=validated[names.DRAFT])
    return VocabSubsetInfo(n, vocab_subset.ORDER)


def _check_draft_vocab(options: ExportOptions, streaming) -> None:
    if options.draft_vocab is not None and (options.static_draft or streaming is not None):
        raise ExportOptionError("--draft-vocab was given with " + ("--static-draft" if options.static_draft else
                                                                   "a streaming draft"),
                                "only the plain draft graph (draft.onnx) is cut to a vocabulary subset",
                                "drop --draft-vocab, or export that draft without it")


def draft_storage(options: ExportOptions) -> str:
    return options.draft_weight_storage or options.weight_storage


def check_storage(options: ExportOptions) -> None:
    """Storage names, and no vocabulary cut of a packed draft head (export/vocab_subset.py cuts initializers)."""
    from mirrorsd.export.packed_weights import STORAGES

    for flag, value in (("--weight-storage", options.weight_storage),
                        ("--draft-weight-storage", draft_storage(options))):
        if value not in STORAGES:
            raise ExportOptionError(f"{flag} {value!r} is not a storage", f"choose one of {', '.join(STORAGES)}",
                                    f"for example {flag} plain")
    if options.draft_vocab is not None and draft_storage(options) == "packed":
        raise ExportOptionError("--draft-vocab cannot cut a packed draft head",
                                "the cut slices the head's MatMulNBits initializers, which packed storage computes "
                                "at load", "add --draft-weight-storage plain (the target can stay packed)")


def _recorded_options(options: ExportOptions) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items() if k not in RUN_ONLY}


def _fingerprint(options: ExportOptions, target, draft) -> dict:
    """What a resumed export must share with the run that started it: options, source files, exporter version."""
    import mirrorsd
    from mirrorsd.export.resume import source_stamp

    sources = {"target": source_stamp(target.path)}
    if draft.path != target.path:
        sources["draft"] = source_stamp(draft.path)
    return {"options": _recorded_options(options), "sources": sources, "mirrorsd": mirrorsd.__version__}


def _check_static_options(options: ExportOptions) -> None:
    if options.top_k < 1:
        raise ExportOptionError(f"--top-k {options.top_k} is out of range", "it must be at least 1",
                                f"use the default {DEFAULT_TOP_K}")


def _check_fp16(options: ExportOptions, streaming) -> None:
    """fp16 graphs are traced layer by layer in half precision; a graph traced whole cannot be made fp16 after."""
    if "fp16" not in (options.target_precision, options.draft_precision):
        return
    if options.whole_graphs:
        raise ExportOptionError("fp16 was asked for together with --whole-graphs",
                                "fp16 graphs are built layer by layer in half precision", "drop --whole-graphs")
    if streaming is not None and options.draft_precision == "fp16":
        raise ExportOptionError("An fp16 draft was asked for with a streaming draft",
                                "the streaming draft is traced whole, and only int8/int4 apply after tracing",
                                "use --draft-precision fp32, int8 or int4 for this draft")


def _optional_graphs(options: ExportOptions, draft) -> tuple:
    return (draft_static.Graph(_max_context(options, draft)),) if options.static_draft else ()


def _max_context(options: ExportOptions, draft) -> int:
    if options.max_context is not None:
        return options.max_context
    return min(draft_static.DEFAULT_MAX_CONTEXT, draft.info.max_position_embeddings)


def _check_max_context(options: ExportOptions, draft_positions: int | None) -> None:
    """Before loading (``draft_positions`` None): the flags; after: the range against the draft's positions."""
    if options.max_context is None:
        return
    if not options.static_draft:
        raise ExportOptionError("--max-context was given without --static-draft",
                                "it sets the static draft's KV capacity", "add --static-draft, or drop it")
    limit = draft_positions or 1 << 30
    if not draft_static.MIN_CONTEXT <= options.max_context <= limit:
        raise ExportOptionError(f"--max-context {options.max_context} is out of range",
                                f"it must be {draft_static.MIN_CONTEXT}..{draft_positions or 'the draft positions'}",
                                f"for example --max-context {min(draft_static.DEFAULT_MAX_CONTEXT, limit)}")


def _open_draft(options: ExportOptions, target, progress):
    from mirrorsd.export.loading import open_model

    """The draft model: --draft's model (its first --draft-layers layers when both are given), or the target's
    first --draft-layers layers (default N/4)."""
    source, whose = target, "the target"
    if options.draft is not None:
        progress("opening draft")
        source, whose = open_model(options.draft, options.trust_remote_code), "the draft"
        if options.draft_layers is None:
            return source
    n = source.info.num_layers
    k = options.draft_layers if options.draft_layers is not None else max(1, n // 4)
    if not 1 <= k <= n:
        raise ExportOptionError(f"--draft-layers {k} is out of range", f"{whose} has {n} layers; use 1..{n}",
                                f"for example --draft-layers {max(1, n // 4)}")
    return source.truncated(k)


def _exit_layer(options: ExportOptions, n: int, progress=lambda step: None) -> tuple[int, dict | None]:
    """The exit layer, and the latency model's choice behind it (None when --exit-layer or the default N/2)."""
    given = (options.exit_hits is not None, options.exit_profile is not None)
    if any(given) and not all(given):
        missing = "--exit-profile" if given[0] else "--exit-hits"
        raise ExportOptionError(f"{missing} is missing", "the export picks the exit layer from a hit-rate sweep "
                                "and a measured profile together", f"pass {missing} too, or give --exit-layer L")
    choice = None
    if options.exit_layer is None and all(given):
        from mirrorsd.export.exit_choice import choose_exit_layer

        choice = choose_exit_layer(options.exit_hits, options.exit_profile, n)
        noexit = choice["predicted_mirror_noexit_tokens_per_second"]
        progress(f"exit layer {choice['layer']}: the latency model's choice ({choice['predicted_tokens_per_second']} "
                 f"tok/s predicted for Mirror-SD on split {choice['split']}"
                 + (f"; without the exit head {noexit} is predicted: the exit does not pay on that profile)"
                    if noexit > choice["predicted_tokens_per_second"] else ")"))
    layer = choice["layer"] if choice else options.exit_layer if options.exit_layer is not None else n // 2
    if not 1 <= layer <= n - 1:
        raise ExportOptionError(f"--exit-layer {layer} is out of range",
                                f"the prefix and the suffix each need at least one of the target's {n} layers",
                                f"use 1..{n - 1} (default {n // 2})")
    return layer, choice


def _save_tokenizer(target, scratch: Path) -> TokenizerInfo:
    tok = target.tokenizer
    tok.save_pretrained(str(scratch / names.TOKENIZER_DIR))
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(tok.eos_token_id)
    return TokenizerInfo(names.TOKENIZER_DIR, tok.bos_token_id, tuple(int(e) for e in eos_ids), tok.pad_token_id,
                         getattr(tok, "chat_template", None))


def _generation_defaults(target) -> dict:
    gen = getattr(target.model, "generation_config", None)
    keys = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")
    return {k: getattr(gen, k) for k in keys if gen is not None and getattr(gen, k, None) is not None}


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch
    import transformers

    import mirrorsd

    return {"mirrorsd": mirrorsd.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}
