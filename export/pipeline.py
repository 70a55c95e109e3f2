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
from mirrorsd.export.graphs import draft as draft_graph, exit_head, prefix, suffix

GRAPHS = (prefix, exit_head, suffix, draft_graph)  # every graph module: ROLE, MODEL, build()
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
    progress("loading target")
    target = load_model(options.model, options.trust_remote_code)
    draft = _load_draft(options, target, progress)
    check_same_vocabulary(target, draft) if draft is not target else None
    exit_layer = _exit_layer(options, target.info.num_layers)
    if not 1 <= options.top_k <= target.info.vocab_size:
        raise ExportOptionError(f"--top-k {options.top_k} is out of range", f"it must be 1..{target.info.vocab_size}",
                                f"use the default {DEFAULT_TOP_K}")
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        manifest = _write_folder(scratch, options, target, draft, exit_layer, progress)
        _publish(scratch, output)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return ExportResult(output, manifest, time.perf_counter() - started)


def _write_folder(scratch: Path, options: ExportOptions, target, draft, exit_layer: int, progress) -> Manifest:
    from mirrorsd.export.onnx_writer import write_onnx
    from mirrorsd.export.validate import require_all_passed, validate_draft, validate_target

    built = {}
    for graph in GRAPHS:
        source = target if graph.MODEL == "target" else draft
        progress(f"tracing {graph.ROLE}")
        module, io, layer_range = graph.build(source, exit_layer, options.top_k)
        write_onnx(module, io, scratch / names.graph_file(graph.ROLE))
        built[graph.ROLE] = (graph, io, layer_range)
    progress("validating against PyTorch")
    checks = validate_target(scratch, target, exit_layer, options.top_k) + validate_draft(scratch, draft)
    require_all_passed(checks)
    results = {c.name: c.max_abs_diff for c in checks}
    graphs = {}
    for role, (graph, io, layer_range) in built.items():
        mine = {k: v for k, v in results.items() if _check_belongs(k, role)}
        graphs[role] = GraphSpec(role, names.graph_file(role), graph.MODEL, io.inputs, io.outputs, layer_range,
                                 io.kv, mine)
    progress("writing tokenizer and manifest")
    tokenizer = _save_tokenizer(target, scratch)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, target=target.info, draft=draft.info, exit_layer=exit_layer,
        top_k=options.top_k, graphs=graphs, tokenizer=tokenizer, generation_defaults=_generation_defaults(target),
        export_options={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()
                        if k not in ("output", "force")},
        versions=_versions())
    manifest.save(scratch)
    return manifest


def _check_belongs(check: str, role: str) -> bool:
    owners = {"split_hidden": names.PREFIX, "split_logits": names.SUFFIX, "exit_topk_logprobs": names.EXIT_HEAD,
              "cached_logits": names.SUFFIX, "draft_logits": names.DRAFT, "draft_cached_logits": names.DRAFT}
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
