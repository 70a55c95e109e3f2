"""Build, validate and quantize the graphs of one model (the target, then the draft) in the scratch folder.

    1. write each graph     Stack  -> assembly.write_stack: piece by piece, quantized as it is written
                            Traced -> onnx_writer.write_onnx: traced whole, the model's weights all loaded
    2. validate             each graph module against PyTorch, one ONNX Runtime session at a time; a graph written
                            quantized is checked in fp32 piece by piece (chain_runner.ChainRunner)
    3. quantize the rest    graphs written in fp32 that --precision quantizes (traced ones), then the effect of
                            quantization on the model's logits, recorded on the graph that outputs them

Every finished graph and every validated model is recorded in the resume state (resume.py), so an interrupted
``--resume`` export continues where it stopped.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirrorsd import names
from mirrorsd.errors import UnsupportedArchitectureError
from mirrorsd.export.embedding import EmbeddingPlan
from mirrorsd.export.gguf_blocks import block_plan
from mirrorsd.export.graphs.base import HEAD_TOPK, LAYER, STEM_IDS, Stack, Traced
from mirrorsd.export.resume import BUILDING, ResumeState


@dataclass(frozen=True)
class ModelJob:
    """One model's share of the export."""

    model: str  # "target" | "draft"
    source: Any  # ModelSource, opened lazily
    modules: tuple  # graph modules (graphs/base.py protocol), in validation order
    precision: str  # fp32 | fp16 | int8 | int4
    exit_layer: int
    top_k: int
    whole_graphs: bool  # trace every graph whole, as before layer streaming
    gguf_blocks: str = "exact"  # a GGUF source's blocks: carried where they map exactly (gguf_blocks.py)
    embedding: str = "quantized"  # a quantized model's token embedding: quantized | float (embedding.py)
    weight_storage: str = "plain"  # carried GGUF weights on disk: plain | packed (packed_weights.py)


def run_job(job: ModelJob, scratch: Path, state: ResumeState, progress: Callable[[str], None],
            on_layer: Callable[[str, int, int], None]) -> dict[str, tuple[Any, Stack | Traced, dict]]:
    """Write, validate and quantize the job's graphs; {role: (module, build, validation results)}."""
    builds = {m.ROLE: _as_built(m.build(job.source, job.exit_layer, job.top_k), job) for m in job.modules}
    todo = [m for m in job.modules if not state.is_built(m.ROLE, names.graph_file(m.ROLE))]
    chained = {m.ROLE for m in job.modules if _quantized_while_written(m, builds[m.ROLE], job)}
    results = state.validated.get(job.model) if not todo else None
    pieces = Pieces(job, builds, progress)
    blocks = block_plan(job.source, job.precision, job.gguf_blocks, job.weight_storage)
    embedding = EmbeddingPlan(job.embedding, blocks)
    for module in todo:
        _write(module, builds[module.ROLE], pieces, job, scratch, progress, on_layer, blocks, embedding)
        state.mark_built(module.ROLE, {**(blocks.report(module.ROLE) if blocks is not None else {}),
                                       **embedding.report(module.ROLE)})
    if results is None:
        results = _validate_and_quantize(job, builds, pieces, chained, scratch, state, progress, embedding)
        for role in results:  # what the GGUF's blocks and the token embedding became in each quantized graph,
            results[role].update(state.counts.get(role, {}))  # kept across a resumed run
        state.record(job.model, results)
    return {m.ROLE: (m, builds[m.ROLE], results[m.ROLE]) for m in job.modules}


def _as_built(build, job: ModelJob):
    return traced_stack(build, job.source.arch) if job.whole_graphs and isinstance(build, Stack) else build


def traced_stack(stack: Stack, arch) -> Traced:
    """A Stack traced whole, as the exporter did before layer streaming (same modules, same graph)."""
    from mirrorsd.export.graphs.common import LayerRange
    from mirrorsd.export.graphs.exit_head import ExitHead

    def make(model):
        if stack.head == HEAD_TOPK:
            return ExitHead(arch.part(model, arch.final_norm), arch.part(model, arch.lm_head), stack.top_k)
        return LayerRange(model, arch, *stack.layer_range, embed=stack.stem == STEM_IDS, head=stack.head is not None)

    return Traced(make, stack.io, stack.layer_range, stack.static_shapes)


def _quantized_while_written(module, build, job: ModelJob) -> bool:
    """Written in another precision than fp32 layer by layer: the fp32 graph never exists as a file."""
    return isinstance(build, Stack) and module.QUANTIZED and job.precision != "fp32"


class Pieces:
    """The job's traced pieces (templates.py) per dtype, traced on first use only (a resumed job may need none)."""

    def __init__(self, job: ModelJob, builds: dict, progress) -> None:
        self.job, self.progress, self.sets = job, progress, {}
        stacks = [b for b in builds.values() if isinstance(b, Stack)]
        self.kinds = {k for s in stacks for k in (s.stem, s.head, LAYER if s.layer_range[1] > s.layer_range[0]
                                                   else None)} - {None}

    def get(self, dtype) -> dict:
        from mirrorsd.export.templates import trace_pieces

        if dtype not in self.sets:
            config = self.job.source.model.config
            types = set(getattr(config, "layer_types", None) or [None])
            if len(types) > 1:
                raise UnsupportedArchitectureError(
                    f"The {self.job.model}'s layers are of several kinds ({sorted(types)})",
                    "layer streaming traces one layer and repeats it", "export with --whole-graphs")
            self.progress(f"tracing the {self.job.model}'s pieces in {str(dtype).removeprefix('torch.')} "
                          f"({', '.join(sorted(self.kinds))})")
            self.sets[dtype] = trace_pieces(config, self.job.source.arch, self.kinds, self.job.top_k, dtype)
        return self.sets[dtype]

    def for_writing(self, module):
        import torch

        half = module.QUANTIZED and self.job.precision == "fp16"
        return self.get(torch.float16 if half else torch.float32)

    def fp32(self) -> dict:
        import torch

        return self.get(torch.float32)


def _write(module, build, pieces: Pieces, job: ModelJob, scratch: Path, progress, on_layer, blocks=None,
           embedding=None) -> None:
    from mirrorsd.export import onnx_writer
    from mirrorsd.export.assembly import write_stack

    file = names.graph_file(module.ROLE)
    building = scratch / f"{BUILDING}{module.ROLE}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    if isinstance(build, Stack):
        traced = pieces.for_writing(module)
        layers = build.layer_range[1] - build.layer_range[0]
        progress(f"writing {module.ROLE} ({layers} layers{_precision_note(module, job)})" if layers else
                 f"writing {module.ROLE}{_precision_note(module, job).replace(',', ' in')}")
        precision = job.precision if module.QUANTIZED else "fp32"
        write_stack(build, traced, job.source, building / file, precision, job.model,
                    lambda done, total: on_layer(module.ROLE, done, total),
                    blocks if precision == job.precision else None, embedding)
    else:
        progress(f"tracing {module.ROLE} (the whole {job.model} in memory)")
        with job.source.weights.materialized() as model:
            onnx_writer.write_onnx(build.make(model), build.io, building / file)
    for item in building.iterdir():
        (scratch / item.name).unlink(missing_ok=True)
        item.rename(scratch / item.name)
    building.rmdir()


def _precision_note(module, job: ModelJob) -> str:
    return f", {job.precision}" if module.QUANTIZED and job.precision != "fp32" else ""


def _validate_and_quantize(job: ModelJob, builds: dict, pieces: Pieces, chained: set, scratch: Path,
                           state: ResumeState, progress, embedding=None) -> dict[str, dict]:
    from mirrorsd.export import chain_runner, validate
    from mirrorsd.export.graphs.attention import KIND
    from mirrorsd.export.quantize import QUANTIZED, quantize_graph

    shared: dict = {}
    checks = {}
    for module in job.modules:
        build = builds[module.ROLE]
        how = " (fp32, piece by piece)" if module.ROLE in chained else ""
        progress(f"validating {module.ROLE} against PyTorch{how}")
        runner = chain_runner.ChainRunner(build, pieces.fp32(), job.source) if module.ROLE in chained else \
            validate.FileRunner(scratch / names.graph_file(module.ROLE), build.io.kv)
        checks[module.ROLE] = module.validate(validate.Validation(job.source, runner, job.exit_layer, shared))
        del runner  # one session at a time: a graph's weights leave memory before the next graph's come in
    validate.require_all_passed([c for cs in checks.values() for c in cs])
    results = {role: {c.name: c.max_abs_diff for c in cs} for role, cs in checks.items()}
    if job.precision != "fp32":
        later = [m.ROLE for m in job.modules if m.QUANTIZED and m.ROLE not in chained and job.precision in QUANTIZED]
        state.unbuild(later)  # an interruption while they change precision rebuilds them
        for role in later:
            progress(f"quantizing {role} to {job.precision}")
            quantize_graph(scratch / names.graph_file(role), job.precision, model=job.model, attention=KIND,
                           embedding=embedding)
        progress(f"measuring what {job.precision} changes in the {job.model}'s logits")
        for role, effect in _effect(job, builds, shared, scratch).items():
            results[role].update(effect)
        state.record(job.model, results)  # before the files count as built: a resumed run never re-checks
        for role in later:                # a quantized file against fp32 tolerances
            state.mark_built(role, embedding.report(role) if embedding is not None else {})
    state.record(job.model, results)
    return results


def _effect(job: ModelJob, builds: dict, shared: dict, scratch: Path) -> dict[str, dict]:
    """The quantization effect on the model's logits, keyed by the graph that records it (QUANT_EFFECT)."""
    from mirrorsd.export import validate

    owners = [m for m in job.modules if m.QUANT_EFFECT == job.model]
    if not owners:
        return {}
    owner = owners[0]
    before = shared[owner.ROLE]["full"][names.LOGITS]
    kv = {role: build.io.kv for role, build in builds.items()}
    after, mask = validate.model_logits(scratch, job.model, job.source.info, job.exit_layer, kv)
    effect = validate.quantization_effect(job.model, before, after, mask)
    tokenizer = job.source.tokenizer
    text = validate.text_batch(tokenizer and (lambda t: tokenizer(t)["input_ids"]), job.source.info)
    if text is not None:  # and on real text: the fp32 model in PyTorch against the quantized files
        info = job.source.info
        reference = validate.torch_reference(job.source, *text, info.num_layers, None)[0]
        quantized, _ = validate.model_logits(scratch, job.model, info, job.exit_layer, kv, batch=text)
        effect.update(validate.text_agreement(job.model, reference, quantized))
    return {owner.ROLE: effect}
