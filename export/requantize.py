"""Quantize an existing fp32 export folder into a new one, without re-tracing.

    mirrorsd quantize --model exports/qwen --output exports/qwen-d4 --draft-precision int4

The new folder's manifest records the precisions and each quantized graph's effect on logits (max |diff| and top-1
agreement against the fp32 graphs on the validation batch). Written atomically like an export (publish.py), with
the export's own quantization step (quantize.py) and graph modules (graphs/registry.py).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from mirrorsd.errors import ExportOptionError
from mirrorsd.manifest import load_manifest
from mirrorsd.export.graphs import registry
from mirrorsd.export.publish import StagedFolder
from mirrorsd.export.quantize import QUANTIZED, check_precision, quantize_graph


def requantize(source: Path, output: Path, target_precision: str, draft_precision: str, force: bool = False) -> Path:
    from mirrorsd.export import validate

    source, output = Path(source).resolve(), Path(output).expanduser().resolve()
    manifest = load_manifest(source)
    allowed = ("fp32", *QUANTIZED)  # fp16 graphs are traced in fp16 (mirrorsd-export --precision fp16)
    check_precision(target_precision, "--target-precision", allowed)
    check_precision(draft_precision, "--draft-precision", allowed)
    done = manifest.export_options
    for key, wanted in (("target_precision", target_precision), ("draft_precision", draft_precision)):
        if done.get(key, "fp32") != "fp32" and wanted != done.get(key):
            raise ExportOptionError(f"'{source}' is already {done[key]} for {key.split('_')[0]}",
                                    "quantizing twice compounds the error", "start from the fp32 export")
    plan = [(model, precision) for model, precision in (("target", target_precision), ("draft", draft_precision))
            if precision != "fp32" and done.get(f"{model}_precision", "fp32") != precision]
    roles = {model: registry.quantized_roles(manifest.graphs, model) for model, _ in plan}
    kv = {role: spec.kv for role, spec in manifest.graphs.items()}
    with StagedFolder(output, force) as stage:
        rewritten = {manifest.graph(role).file for rs in roles.values() for role in rs}
        for item in source.iterdir():
            if item.name in rewritten or item.name.removesuffix(".data") in rewritten:
                continue
            dest = stage.path / item.name
            shutil.copytree(item, dest) if item.is_dir() else _copy(item, dest)
        effects = {}
        for model, precision in plan:
            info = manifest.target if model == "target" else manifest.draft
            before, mask = validate.model_logits(source, model, info, manifest.exit_layer, kv)
            for role in roles[model]:  # read from the source folder: onnx refuses hard-linked external data
                file = manifest.graph(role).file
                quantize_graph(stage.path / file, precision, source=source / file, model=model)
            after, _ = validate.model_logits(stage.path, model, info, manifest.exit_layer, kv)
            effects[registry.effect_owner(model)] = validate.quantization_effect(model, before, after, mask)
        graphs = {role: dataclasses.replace(spec, validation={**spec.validation, **effects.get(role, {})})
                  for role, spec in manifest.graphs.items()}
        options = {**done, "target_precision": target_precision, "draft_precision": draft_precision,
                   "requantized_from": str(source)}
        dataclasses.replace(manifest, graphs=graphs, export_options=options).save(stage.path)
        stage.publish()
    return output


def _copy(src: Path, dst: Path) -> None:
    # A copy, not a hard link: onnx refuses external data with several links ("hardlink attack"), and a link
    # would let a later write into one folder change the other.
    shutil.copy2(src, dst)
