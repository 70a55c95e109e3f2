"""The export as one typed function: load, cut, trace, validate, write the manifest, publish atomically.

The folder appears under its final name only when every graph validated; on any error, Ctrl-C included, the
scratch folder is removed and an existing output folder is left as it was.
"""
from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from mirrorsd import names
from mirrorsd.errors import ExportOptionError, OutputFolderError
from mirrorsd.manifest import SCHEMA_VERSION, GraphSpec, Manifest, TokenizerInfo
from mirrorsd.export.graphs import draft as draft_graph, draft_static, exit_head, prefix, suffix
from mirrorsd.export.quantize import check_precision
from mirrorsd.export.streaming import graph as streaming_graph

GRAPHS = (prefix, exit_head, suffix, draft_graph)  # every graph module: ROLE, MODEL, build()
ATTENTION = "grouped"  # every graph traces export/graphs/attention.py (recorded as Manifest.attention)
DEFAULT_TOP_K = 8


@dataclass(frozen=True)
class ExportOptions:
    model: Path
    output: Path
    draft: Path | None = None
    draft_layers: int | None = None
    exit_layer: int | None = None  # default: half the target's depth
    top_k: int = DEFAULT_TOP_K
    force: bool = False
    trust_remote_code: bool = False
    static_draft: bool = False  # also write draft_static.onnx: fixed KV capacity and step width (NPUs)
    max_context: int | None = None  # the static draft's KV slots (default: min(1024, draft positions))
    target_precision: str = "fp32"  # fp32 | int8 | int4 (weight-only, after fp32 validation; see quantize.py)
    draft_precision: str = "fp32"


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    manifest: Manifest
    seconds: float


def export(options: ExportOptions, progress: Callable[[str], None] = lambda step: None) -> ExportResult:
    from mirrorsd.export.loading import check_same_vocabulary, load_model

    started = time.perf_counter()
    output = Path(options.output).expanduser().resolve()
    _check_output(output, options.force)
    _check_static_options(options)
    _check_max_context(options, None)
    check_precision(options.target_precision, "--target-precision")
    check_precision(options.draft_precision, "--draft-precision")
    progress("loading target")
    target = load_model(options.model, options.trust_remote_code)
    draft = _load_draft(options, target, progress)
    check_same_vocabulary(target, draft) if draft is not target else None
    streaming = streaming_graph.detect(options.draft, draft)  # a mirrorsd-train-draft folder: + draft_streaming
    exit_layer = _exit_layer(options, target.info.num_layers)
    _check_max_context(options, draft.info.max_position_embeddings)
    if not 1 <= options.top_k <= target.info.vocab_size:
        raise ExportOptionError(f"--top-k {options.top_k} is out of range", f"it must be 1..{target.info.vocab_size}",
                                f"use the default {DEFAULT_TOP_K}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as exc:
        raise _write_error(output, exc) from exc
    try:
        manifest = _write_folder(scratch, options, target, draft, exit_layer, progress, streaming)
        _publish(scratch, output)
    except BaseException as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, OSError):  # disk full, quota, permissions: the user's to fix, not a crash
            raise _write_error(output, exc) from exc
        raise
    return ExportResult(output, manifest, time.perf_counter() - started)


def _write_error(output: Path, exc: OSError) -> OutputFolderError:
    return OutputFolderError(f"Could not write the export folder '{output}'", exc.strerror or str(exc),
                             "free some disk space or pick another --output, then export again "
                             "(nothing was left behind; an existing folder is untouched)")


def _write_folder(scratch: Path, options: ExportOptions, target, draft, exit_layer: int, progress,
                  streaming=None) -> Manifest:
    from mirrorsd.export.genai_config import write_genai_config
    from mirrorsd.export.graphs.attention import traced_with_grouped_attention
    from mirrorsd.export.onnx_writer import write_onnx
    from mirrorsd.export.validate import require_all_passed, validate_draft, validate_target

    built = {}
    for graph in GRAPHS + _optional_graphs(options, draft) + ((streaming,) if streaming else ()):
        source = target if graph.MODEL == "target" else draft
        progress(f"tracing {graph.ROLE}")
        module, io, layer_range = graph.build(source, exit_layer, options.top_k)
        with traced_with_grouped_attention(source.model):
            write_onnx(module, io, scratch / names.graph_file(graph.ROLE))
        built[graph.ROLE] = (graph, io, layer_range)
    progress("validating against PyTorch")
    checks = validate_target(scratch, target, exit_layer, options.top_k) + validate_draft(scratch, draft)
    if options.static_draft:
        checks += draft_static.validate(scratch, draft, _max_context(options, draft))
    if streaming is not None:
        checks += streaming.validate(scratch, draft)
    require_all_passed(checks)
    results = {c.name: c.max_abs_diff for c in checks}
    results.update(_quantize(scratch, options, target, draft, exit_layer, progress))
    graphs = {}
    for role, (graph, io, layer_range) in built.items():
        mine = {k: v for k, v in results.items() if _check_belongs(k, role)}
        graphs[role] = GraphSpec(role, names.graph_file(role), graph.MODEL, io.inputs, io.outputs, layer_range,
                                 io.kv, mine, dict(getattr(graph, "static_shapes", {})))
    progress("writing tokenizer and manifest")
    tokenizer = _save_tokenizer(target, scratch)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, target=target.info, draft=draft.info, exit_layer=exit_layer,
        top_k=options.top_k, graphs=graphs, tokenizer=tokenizer, generation_defaults=_generation_defaults(target),
        export_options={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()
                        if k not in ("output", "force")},
        versions=_versions(), attention=ATTENTION)
    manifest.save(scratch)
    write_genai_config(scratch, manifest)  # the target as an onnxruntime-genai decoder-pipeline model
    return manifest


def _quantize(scratch: Path, options: ExportOptions, target, draft, exit_layer: int, progress) -> dict:
    """Quantize the target and/or draft graphs; return the recorded effect on logits, keyed for the manifest."""
    from mirrorsd.export import validate
    from mirrorsd.export.quantize import quantize_graph

    effects = {}
    if options.target_precision != "fp32":
        progress(f"quantizing the target to {options.target_precision}")
        before, mask = validate.split_logits(scratch, target.info, exit_layer)
        for role in (names.PREFIX, names.EXIT_HEAD, names.SUFFIX):
            quantize_graph(scratch / names.graph_file(role), options.target_precision, attention=ATTENTION)
        after, _ = validate.split_logits(scratch, target.info, exit_layer)
        effects.update({f"target_{k}": v for k, v in validate.quantization_effect(before, after, mask).items()})
    if options.draft_precision != "fp32":
        progress(f"quantizing the draft to {options.draft_precision}")
        before, mask = validate.draft_logits(scratch, draft.info)
        quantize_graph(scratch / names.graph_file(names.DRAFT), options.draft_precision, model="draft",
                       attention=ATTENTION)
        streaming_file = scratch / names.graph_file(names.DRAFT_STREAMING)
        if streaming_file.is_file():  # it shares draft.onnx's KV cache: same weights, same precision
            quantize_graph(streaming_file, options.draft_precision, model="draft", attention=ATTENTION)
        after, _ = validate.draft_logits(scratch, draft.info)
        effects.update({f"draft_{k}": v for k, v in validate.quantization_effect(before, after, mask).items()})
    return effects


def _check_belongs(check: str, role: str) -> bool:
    owners = {"split_hidden": names.PREFIX, "split_logits": names.SUFFIX, "exit_topk_logprobs": names.EXIT_HEAD,
              "cached_logits": names.SUFFIX, "draft_logits": names.DRAFT, "draft_cached_logits": names.DRAFT,
              "draft_static_logits": names.DRAFT_STATIC,
              **{f"target_quant_{k}": names.SUFFIX for k in ("max_abs_diff", "top1_agreement")},
              **{f"draft_quant_{k}": names.DRAFT for k in ("max_abs_diff", "top1_agreement")},
              **{name: names.DRAFT_STREAMING for name in streaming_graph.CHECKS}}
    return owners.get(check) == role


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise OutputFolderError(f"Output '{output}' is a file", "the export writes a folder", "pick another --output")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise OutputFolderError(f"Output folder '{output}' is not empty", "exports never overwrite without asking",
                                "pick another --output, or pass --force to replace it")


def _check_static_options(options: ExportOptions) -> None:
    if options.draft is not None and options.draft_layers is not None:
        raise ExportOptionError("--draft and --draft-layers were both given", "a draft is one or the other",
                                "drop one of them")
    if options.top_k < 1:
        raise ExportOptionError(f"--top-k {options.top_k} is out of range", "it must be at least 1",
                                f"use the default {DEFAULT_TOP_K}")


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


def _load_draft(options: ExportOptions, target, progress):
    from mirrorsd.export.loading import load_model

    n = target.info.num_layers
    if options.draft is not None:
        progress("loading draft")
        return load_model(options.draft, options.trust_remote_code)
    k = options.draft_layers if options.draft_layers is not None else max(1, n // 4)
    if not 1 <= k <= n:
        raise ExportOptionError(f"--draft-layers {k} is out of range", f"the target has {n} layers; use 1..{n}",
                                f"for example --draft-layers {max(1, n // 4)}")
    return target.truncated(k)


def _exit_layer(options: ExportOptions, n: int) -> int:
    layer = options.exit_layer if options.exit_layer is not None else n // 2
    if not 1 <= layer <= n - 1:
        raise ExportOptionError(f"--exit-layer {layer} is out of range",
                                f"the prefix and the suffix each need at least one of the target's {n} layers",
                                f"use 1..{n - 1} (default {n // 2})")
    return layer


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


def _publish(scratch: Path, output: Path) -> None:
    """Rename the finished scratch folder into place; a replaced folder is removed only after the swap."""
    os.chmod(scratch, _mkdir_mode(scratch))  # mkdtemp's folder is private (0700); publish it as mkdir would
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.replaced-{os.getpid()}")
        os.replace(output, old)
    try:
        os.replace(scratch, output)
    except BaseException:
        if old is not None:
            os.replace(old, output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _mkdir_mode(inside: Path) -> int:
    """The permissions a plain mkdir gives (the umask applied), read without changing the process umask."""
    probe = inside / ".mode-probe"
    probe.mkdir()
    mode = probe.stat().st_mode & 0o777
    probe.rmdir()
    return mode
