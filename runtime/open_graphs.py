"""Open every graph of an export folder where its placement plan puts it: one backend session per graph role.

    prefix, exit head, suffix   the target's graphs, on the target's device, with the target's threads
    draft (or draft_static)     the draft, on the draft's device (the static graph when the plan says fixed shapes)
    draft_streaming             beside the draft when the export has one and the draft is not static
    exit_sparse                 beside the exit head, on the target's device, when the export has one
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mirrorsd import names
from mirrorsd.manifest import Manifest
from mirrorsd.runtime.session import GraphSession, Timeline, graph_path


def graphs_to_open(manifest: Manifest, plan) -> list[tuple[str, object, str, bool]]:
    """(role, GraphSpec, model whose device and threads it takes, whether its KV pairs are passed) of every graph
    a pipeline opens under ``plan`` (devices.placement.Plan)."""
    graphs = []
    for role in names.GRAPH_ROLES:
        spec = manifest.graph(plan.graph_role(role))  # the draft may be served by draft_static
        graphs.append((role, spec, spec.model, True))
    if names.DRAFT_STREAMING in manifest.graphs and not plan.decision("draft").static:
        spec = manifest.graph(names.DRAFT_STREAMING)  # beside the draft: same device, same KV cache
        graphs.append((spec.role, spec, "draft", False))
    if names.EXIT_SPARSE in manifest.graphs:  # beside the exit head, on the target's device
        spec = manifest.graph(names.EXIT_SPARSE)
        graphs.append((spec.role, spec, "target", False))
    return graphs


def request_for(devices, graphs):
    """``devices`` as opening ``graphs`` (graphs_to_open) applies it: beside a streaming draft the draft's cache is not
    written in place (both draft graphs feed one cache, as exported)."""
    if any(role == names.DRAFT_STREAMING for role, *_ in graphs):
        return replace(devices, draft_kv_in_place=False)
    return devices


def open_sessions(folder: Path, manifest: Manifest, devices, threads: tuple[int, int], plan=None
                  ) -> tuple[dict, dict]:
    """(sessions, placements) of every graph, with ``threads`` intra-op threads (target, draft); ``plan`` is the
    placement plan of ``devices`` when the caller made it already (else it is made here, warning as it does)."""
    from mirrorsd.devices import thread_pool
    from mirrorsd.devices.placement import open_graph, plan_placement

    timelines = {"target": Timeline(), "draft": Timeline()}
    plan = plan or plan_placement(manifest, devices)  # decided once for both models; warns when auto fell back
    devices = replace(devices, shared_pool=thread_pool.resolve(devices.shared_pool, threads,
                                                               thread_pool.shared_size()))
    graphs = graphs_to_open(manifest, plan)
    devices = request_for(devices, graphs)
    sessions, placements = {}, {}
    for role, spec, model, with_kv in graphs:
        logits = spec.output_names()[0] if role in (names.SUFFIX, names.DRAFT) else ""  # their LM heads
        backend, placement = open_graph(graph_path(folder, spec), spec.model, devices,
                                        threads[0] if model == "target" else threads[1], plan.decision(model),
                                        spec.kv if with_kv else None, plan.kernels, logits)
        sessions[role] = GraphSession(spec, backend, placement, timelines[model])
        placements[role] = placement
    return sessions, placements
