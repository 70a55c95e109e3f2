"""Merge an export's prefix.onnx and suffix.onnx into one unsplit ONNX graph of the same weights (no re-export).

    input_ids --> [prefix] --hidden_states--> [suffix] --> logits
    attention_mask, position_ids: fed once, read by both halves
    past 0..e-1 --> [prefix] --> present 0..e-1
    past e..N-1 -------------------------------> [suffix] --> present e..N-1

The suffix's internal names (node outputs and names, initializers, value_info) get SUFFIX_SCOPE in front so that
they cannot collide with the prefix's; graph inputs and outputs keep their manifest names. onnx.compose.merge_models
does not do this: without a prefix it refuses the shared names, with one it prefixes the suffix's inputs and outputs
too (suffix/attention_mask, suffix/logits: shared inputs fed twice). Used by split_overhead.py --merge.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from mirrorsd import names
from mirrorsd.errors import GraphFileError, ManifestError
from mirrorsd.manifest import GraphSpec, KVSpec, Manifest
from mirrorsd.runtime.models import DraftModel
from mirrorsd.runtime.session import GraphSession, Timeline, graph_path

UNSPLIT_FILE = "unsplit.onnx"
SUFFIX_SCOPE = "suffix/"  # onnx.compose's way to keep two graphs' names apart: a prefix on every internal name


def present_names(kv: KVSpec) -> set[str]:
    return {template % i for i in kv.layer_indices() for template in (kv.present_key, kv.present_value)}


def unsplit_spec(manifest: Manifest) -> GraphSpec:
    """The merged graph's entry: the prefix's inputs + the suffix's past KV; logits + every present KV."""
    prefix, suffix = manifest.graph(names.PREFIX), manifest.graph(names.SUFFIX)
    if dataclasses.replace(prefix.kv, layers=suffix.kv.layers) != suffix.kv or \
            prefix.kv.layers[1] != suffix.kv.layers[0]:
        raise ManifestError("The prefix and suffix KV specs do not join into one", f"{prefix.kv} vs {suffix.kv}",
                            "re-export the folder with this version of mirrorsd-export")
    shared = {t.name: t for t in prefix.inputs}
    mismatched = [t.name for t in suffix.inputs[1:] if t.name in shared and shared[t.name] != t]
    if mismatched:
        raise ManifestError(f"Prefix and suffix describe the inputs {mismatched} differently",
                            "a merged graph feeds them once to both", "re-export the folder")
    inputs = prefix.inputs + tuple(t for t in suffix.inputs[1:] if t.name not in shared)  # [0]: hidden state
    presents = present_names(prefix.kv) | present_names(suffix.kv)
    outputs = (suffix.outputs[0],) + tuple(t for g in (prefix, suffix) for t in g.outputs if t.name in presents)
    kv = dataclasses.replace(prefix.kv, layers=(prefix.kv.layers[0], suffix.kv.layers[1]))
    return GraphSpec("unsplit", UNSPLIT_FILE, "target", inputs, outputs,
                     (prefix.layer_range[0], suffix.layer_range[1]), kv)


def build_unsplit(folder: Path, manifest: Manifest, path: Path) -> None:
    """Write the merged graph to ``path``, its weights to ``path``.data beside it."""
    import onnx
    from onnx.compose import add_prefix_graph

    spec = unsplit_spec(manifest)
    prefix_spec, suffix_spec = manifest.graph(names.PREFIX), manifest.graph(names.SUFFIX)
    model = onnx.load(str(graph_path(folder, prefix_spec)))  # external data is read in too
    suffix = onnx.load(str(graph_path(folder, suffix_spec)))
    if {(o.domain, o.version) for o in model.opset_import} != {(o.domain, o.version) for o in suffix.opset_import}:
        raise GraphFileError("prefix.onnx and suffix.onnx import different opsets", "one graph needs one opset",
                             "re-export the folder")
    g, s = model.graph, suffix.graph
    io = {v.name for v in (*s.input, *s.output)}
    _keep(s.value_info, [v for v in s.value_info if v.name not in io])  # else add_prefix_graph renames I/O edges
    add_prefix_graph(s, SUFFIX_SCOPE, rename_inputs=False, rename_outputs=False, inplace=True,
                     name_map={suffix_spec.inputs[0].name: prefix_spec.outputs[0].name})  # hidden in <- hidden out
    for field in ("node", "initializer", "sparse_initializer", "value_info"):
        getattr(g, field).extend(getattr(s, field))
        del getattr(s, field)[:]  # free the suffix's copy of its weights at once
    _merge_functions(model, suffix)
    inputs = {v.name: v for v in (*s.input, *g.input)}  # the prefix's entry wins for shared inputs
    outputs = {v.name: v for v in (*g.output, *s.output)}
    _keep(g.input, [inputs[t.name] for t in spec.inputs])
    _keep(g.output, [outputs[t.name] for t in spec.outputs])
    g.name = "unsplit"
    _check_unique(g)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    partial = path.with_name(path.name + ".partial")  # renamed at the end: an unsplit.onnx is always complete
    onnx.save_model(model, str(partial), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name)
    partial.replace(path)


def _keep(repeated, items) -> None:
    """Replace a repeated protobuf field's content by ``items`` (copied first: clearing detaches them)."""
    copies = [type(item).FromString(item.SerializeToString()) for item in items]
    del repeated[:]
    repeated.extend(copies)


def _merge_functions(model, suffix) -> None:
    known = {(f.domain, f.name): f for f in model.functions}
    for f in suffix.functions:
        twin = known.get((f.domain, f.name))
        if twin is None:
            model.functions.append(f)
        elif twin.SerializeToString() != f.SerializeToString():
            raise GraphFileError(f"prefix and suffix define the local function {f.name} differently",
                                 "a merged model holds one function per name", "re-export the folder")


def _check_unique(graph) -> None:
    produced = [t.name for t in graph.initializer] + [i.name for i in graph.input] + \
               [o for n in graph.node for o in n.output if o]
    seen, twice = set(), set()
    for name in produced:
        (twice if name in seen else seen).add(name)
    if twice:
        raise GraphFileError(f"The merged graph defines {sorted(twice)[:4]} twice",
                             f"a prefix-graph name already starts with '{SUFFIX_SCOPE}'", "change SUFFIX_SCOPE")


def open_unsplit(folder: Path, manifest: Manifest, scratch: Path, devices, threads: int) -> DraftModel:
    """Build ``scratch``/unsplit.onnx unless it is there, open it as the target is opened, wrap it in a decoder."""
    from mirrorsd.devices.placement import open_graph

    folder, scratch = Path(folder).resolve(), Path(scratch).resolve()
    if scratch.is_relative_to(folder):
        raise SystemExit(f"--merge {scratch}: pick a scratch folder outside the export folder {folder}")
    path = scratch / UNSPLIT_FILE
    if path.is_file():
        print(f"reusing {path} (delete it to rebuild)")
    else:
        start = time.perf_counter()
        build_unsplit(folder, manifest, path)
        print(f"built {path} in {time.perf_counter() - start:.1f} s")
    backend, placement = open_graph(path, "target", devices, threads)
    return DraftModel(GraphSession(unsplit_spec(manifest), backend, placement, Timeline()))
