"""Quantize an existing fp32 export folder into a new one, without re-tracing.

    mirrorsd quantize --model exports/qwen --output exports/qwen-d4 --draft-precision int4

The new folder's manifest records the precisions and each quantized graph's effect on logits (max |diff| and top-1
agreement against the fp32 graphs on the validation batch). Written atomically like an export
(mirrorsd/output_folder.py), with the export's own quantization step (quantize.py) and graph modules
(graphs/registry.py). A precision left as None keeps that model as it is.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

from mirrorsd.errors import ExportOptionError
from mirrorsd.manifest import load_manifest
from mirrorsd.export.graphs import registry
from mirrorsd.export.quantize import QUANTIZED, check_precision, quantize_graph
from mirrorsd.output_folder import EXPORT, StagedFolder, check_output, copy_file
from mirrorsd.runtime.session import check_source_folder


def requantize(source: Path, output: Path, target_precision: str | None = None, draft_precision: str | None = None,
               force: bool = False, progress: Callable[[str], None] = lambda step: None,
               scale_search: str = "none", head_bits: int | None = None, embedding: str = "quantized") -> Path:
    """Quantize a copy of ``source`` into ``output``; a precision left as None keeps that model as it is.
    ``scale_search`` and ``head_bits``: rounding.py's options (defaults: ONNX Runtime's round-to-nearest);
    ``embedding``: the token embedding's form (embedding.py; quantized: 8-bit blocks, float: as it is)."""
    from mirrorsd.export import validate
    from mirrorsd.export.embedding import EmbeddingPlan, check_mode
    from mirrorsd.export.rounding import RoundingOptions

    RoundingOptions(scale_search, head_bits)  # checks both before anything is read
    check_mode(embedding)

    source = Path(source).expanduser().resolve()
    manifest = load_manifest(source)
    done = manifest.export_options
    wanted = {"target": target_precision, "draft": draft_precision}
    if not any(wanted.values()):
        raise ExportOptionError("Neither --target-precision nor --draft-precision was given",
                                "there is nothing to quantize", "pass one of them (fp32, int8 or int4)")
    allowed = ("fp32", *QUANTIZED)  # fp16 graphs are traced in fp16 (mirrorsd-export --precision fp16)
    for model, precision in wanted.items():
        if precision is None:
            continue
        check_precision(precision, f"--{model}-precision", allowed)
        if done.get(f"{model}_precision", "fp32") not in ("fp32", precision):
            raise ExportOptionError(f"'{source}' is already {done[f'{model}_precision']} for {model}",
                                    "quantizing twice compounds the error", "start from the fp32 export")
    output = check_output(output, [source], force, EXPORT)
    check_source_folder(source, manifest, "quantize")
    plan = [(model, precision) for model, precision in wanted.items()
            if precision not in (None, "fp32", done.get(f"{model}_precision", "fp32"))]
    roles = {model: registry.quantized_roles(manifest.graphs, model) for model, _ in plan}
    kv = {role: spec.kv for role, spec in manifest.graphs.items()}
    with StagedFolder(output) as stage:
        progress("copying the graphs that stay as they are")
        rewritten = {manifest.graph(role).file for rs in roles.values() for role in rs}
        for item in source.iterdir():
            if item.name in rewritten or item.name.removesuffix(".data") in rewritten:
                continue
            dest = stage.path / item.name
            shutil.copytree(item, dest) if item.is_dir() else copy_file(item, dest)
        effects, counts = {}, {}
        for model, precision in plan:
            progress(f"quantizing the {model} to {precision}")
            info = manifest.target if model == "target" else manifest.draft
            rounding = _rounding(manifest, info, scale_search, head_bits, progress)
            table = EmbeddingPlan(embedding)
            before, mask = validate.model_logits(source, model, info, manifest.exit_layer, kv)
            for role in roles[model]:  # read from the source folder: onnx refuses hard-linked external data
                file = manifest.graph(role).file
                quantize_graph(stage.path / file, precision, source=source / file, model=model,
                               attention=manifest.attention, rounding=rounding, embedding=table)
                counts[role] = table.report(file.removesuffix(".onnx"))
            after, _ = validate.model_logits(stage.path, model, info, manifest.exit_layer, kv)
            effects[registry.effect_owner(model)] = validate.quantization_effect(model, before, after, mask)
            text = validate.text_batch(_encoder(source, manifest), info)
            if text is not None:  # the fp32 graphs against the quantized ones on the shipped text
                fp32, _ = validate.model_logits(source, model, info, manifest.exit_layer, kv, batch=text)
                quantized, _ = validate.model_logits(stage.path, model, info, manifest.exit_layer, kv, batch=text)
                effects[registry.effect_owner(model)].update(validate.text_agreement(model, fp32, quantized))
        graphs = {role: dataclasses.replace(spec, validation={**spec.validation, **effects.get(role, {}),
                                                              **counts.get(role, {})})
                  for role, spec in manifest.graphs.items()}
        kept = {f"{model}_precision": precision or done.get(f"{model}_precision", "fp32")
                for model, precision in wanted.items()}
        options = {**done, **kept, "requantized_from": str(source), "embedding": embedding}
        if scale_search != "none" or head_bits is not None:
            options["rounding"] = {"scale_search": scale_search, "head_bits": head_bits}
        dataclasses.replace(manifest, graphs=graphs, export_options=options).save(stage.path)
        stage.publish()
    return output


def _encoder(folder: Path, manifest):
    """The export folder's own tokenizer as text -> ids (special tokens as the tokenizer adds them)."""
    from mirrorsd.runtime.text import TextCodec

    codec = TextCodec(folder, manifest)
    return lambda text: codec.encode(text, chat=False)


def _rounding(manifest, info, scale_search: str, head_bits: int | None, progress):
    """The RoundingOptions of one model; "data" measures its activations on the calibration text first (a draft
    made of the target's first layers shares the target's statistics)."""
    from mirrorsd.export.rounding import RoundingOptions

    importance = None
    if scale_search == "data":
        from mirrorsd.export.calibration import channel_importance

        source = info.source.split(" (first ")[0]
        progress(f"measuring {source}'s activations on the calibration text")
        importance = channel_importance(source)
    return RoundingOptions(scale_search, head_bits, info.vocab_size, importance)
