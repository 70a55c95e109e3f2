"""Quantize an existing fp32 export folder into a new one, without PyTorch and without re-tracing.

    mirrorsd quantize --model exports/qwen --output exports/qwen-d4 --draft-precision int4

The new folder's manifest records the precisions and each quantized graph's effect on logits (max |diff| and top-1
agreement against the fp32 graphs on the validation batch). Written atomically like an export.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from mirrorsd import names
from mirrorsd.errors import ExportOptionError
from mirrorsd.manifest import load_manifest
from mirrorsd.export.quantize import check_precision, quantize_graph

TARGET_ROLES = (names.PREFIX, names.EXIT_HEAD, names.SUFFIX)


def requantize(source: Path, output: Path, target_precision: str, draft_precision: str, force: bool = False) -> Path:
    from mirrorsd.export import validate
    from mirrorsd.export.pipeline import _check_output, _publish

    source, output = Path(source).resolve(), Path(output).expanduser().resolve()
    manifest = load_manifest(source)
    check_precision(target_precision, "--target-precision")
    check_precision(draft_precision, "--draft-precision")
    done = manifest.export_options
    for key, wanted in (("target_precision", target_precision), ("draft_precision", draft_precision)):
        if done.get(key, "fp32") != "fp32" and wanted != done.get(key):
            raise ExportOptionError(f"'{source}' is already {done[key]} for {key.split('_')[0]}",
                                    "quantizing twice compounds the error", "start from the fp32 export")
    _check_output(output, force)
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        draft_roles = (names.DRAFT,) + ((names.DRAFT_STREAMING,) if names.DRAFT_STREAMING in manifest.graphs else ())
        plan = [(target_precision, TARGET_ROLES, "target", names.SUFFIX),
                (draft_precision, draft_roles, "draft", names.DRAFT)]  # the streaming draft shares draft's weights
        plan = [step for step in plan if step[0] != "fp32" and done.get(f"{step[2]}_precision", "fp32") != step[0]]
        rewritten = {manifest.graph(role).file for _, roles, _, _ in plan for role in roles}
        for item in source.iterdir():
            if item.name in rewritten or item.name.removesuffix(".data") in rewritten:
                continue
            dest = scratch / item.name
            shutil.copytree(item, dest) if item.is_dir() else _copy(item, dest)
        effects = {}
        for precision, roles, model, owner in plan:
            measure = (lambda folder: validate.split_logits(folder, manifest.target, manifest.exit_layer)) \
                if model == "target" else (lambda folder: validate.draft_logits(folder, manifest.draft))
            before, mask = measure(source)
            for role in roles:  # read from the source folder: onnx refuses hard-linked external data
                file = manifest.graph(role).file
                quantize_graph(scratch / file, precision, source=source / file, model=model,
                               attention=manifest.attention)
            after, _ = measure(scratch)
            effects[owner] = {f"{model}_{k}": v for k, v in validate.quantization_effect(before, after, mask).items()}
        graphs = {role: dataclasses.replace(spec, validation={**spec.validation, **effects.get(role, {})})
                  for role, spec in manifest.graphs.items()}
        options = {**done, "target_precision": target_precision, "draft_precision": draft_precision,
                   "requantized_from": str(source)}
        dataclasses.replace(manifest, graphs=graphs, export_options=options).save(scratch)
        _publish(scratch, output)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return output


def _copy(src: Path, dst: Path) -> None:
    # A copy, not a hard link: onnx refuses external data with several links ("hardlink attack"), and a link
    # would let a later write into one folder change the other.
    shutil.copy2(src, dst)
