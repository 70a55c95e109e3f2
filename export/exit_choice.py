"""The exit layer the export picks when no ``--exit-layer`` is given but a hit-rate sweep and a profile are:
the layer the latency model (runtime/planner/exit_layer.py) predicts fastest for Mirror-SD.

    hits      ``--exit-hits SWEEP.json``: mirrorsd-exit-sweep's --json output for this target (the exit's
              top-4 hit rate on the target's final token at each swept layer; the trained adapter's by default)
    costs     ``--exit-profile PROFILE.json``: a measured profile of an earlier export of the same pair on the
              machine it will run on (`mirrorsd devices --profile --model EXPORT`), with prefix times and the exit
              layer it was measured at
    choose    every swept layer on every split of the profile with prefix times; the (split, layer) with the
              largest predicted tok/s wins; ties go to the shallower layer

Both inputs are measurements the export does not repeat (the sweep needs the target in fp32 and minutes of
training per layer; the profile needs the deployment machine), so the choice is only as current as they are. The
choice, its inputs and its prediction are recorded in the manifest's export_options["exit_layer_choice"]; a
prediction, labelled so.
"""
from __future__ import annotations

from pathlib import Path

from mirrorsd.errors import ExportOptionError, ProfileError

TOPK = 4  # the hit rate the table ranks by: the exit's top-4 (the draft's runner-up candidates are 4 per row)


def read_inputs(hits_file: Path, profile_file: Path, kind: str = "trained"):
    """(hits by layer, the swept model's layer count or None, the profile): both files read and checked, before
    the export opens a model (a bad file fails in a second)."""
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.runtime.planner.exit_layer import read_hits_file

    fix = "pass the --json output of mirrorsd-exit-sweep for this target, or give --exit-layer L"
    fail = lambda why: ExportOptionError(f"Cannot read the exit-layer sweep {hits_file}", why, fix)  # noqa: E731
    hits, swept = read_hits_file(hits_file, TOPK, kind, fail)
    try:
        profile = profiles.load(profile_file)
    except ProfileError as exc:
        raise ExportOptionError(f"Cannot use the profile {profile_file}", f"{exc.what} ({exc.why})",
                                "pass a measured profile (`mirrorsd devices --profile --model EXPORT` caches one), "
                                "or give --exit-layer L") from None
    if profile.acceptance is None:
        raise ExportOptionError(f"The profile {profile_file} has no acceptance statistics",
                                "reuse with and without the exit head anchors the prediction",
                                "measure it with `mirrorsd devices --profile --model EXPORT`, or give --exit-layer L")
    return hits, swept, profile


def choose_exit_layer(hits_file: Path, profile_file: Path, num_layers: int, kind: str = "trained") -> dict:
    """The exit layer of a target with ``num_layers`` layers that the latency model predicts fastest (see the
    module docstring), with the table behind it."""
    from mirrorsd.runtime.planner.exit_layer import exit_layer_table, format_exit_table, noexit_tokens_per_second

    fix = "pass the --json output of mirrorsd-exit-sweep for this target, or give --exit-layer L"
    hits, swept, profile = read_inputs(hits_file, profile_file, kind)
    if swept is not None and swept != num_layers:
        raise ExportOptionError(f"The sweep {hits_file} is of a {swept}-layer model",
                                f"this target has {num_layers} layers", fix)
    hits = {layer: hit for layer, hit in hits.items() if 1 <= layer <= num_layers - 1}
    if not hits:
        raise ExportOptionError(f"The sweep {hits_file} holds no layer in 1..{num_layers - 1}",
                                "an exit layer needs at least one layer before and after it", fix)
    best = None
    for costs, detail in zip(profile.splits, profile.detail or ({},) * len(profile.splits)):
        base = (detail or {}).get("exit_layer")
        if not costs.prefix_s or not base:
            continue
        rows = exit_layer_table(costs, profile.acceptance, hits, int(base))
        if best is None or rows[0].tokens_per_second > best[1][0].tokens_per_second:
            best = (costs, rows, noexit_tokens_per_second(costs, profile.acceptance), int(base))
    if best is None:
        raise ExportOptionError(f"The profile {profile_file} has no split with prefix times and an exit layer",
                                "the prediction moves the prefix's cost with the layer",
                                "re-measure it with this mirrorsd (`mirrorsd devices --profile --model EXPORT`), "
                                "or give --exit-layer L")
    costs, rows, noexit, base = best
    top = rows[0]
    return {"layer": top.layer, "predicted_tokens_per_second": round(top.tokens_per_second, 2),
            "predicted_gamma": top.gamma, "predicted_mirror_noexit_tokens_per_second": round(noexit, 2),
            "split": costs.split, "profile_exit_layer": base, "hit_rate": round(top.hit, 4),
            "hits": {str(k): v for k, v in sorted(hits.items())}, "hit_kind": f"{kind} top-{TOPK}",
            "sweep": str(hits_file), "profile": str(profile_file), "kind": "prediction (latency model)",
            "table": format_exit_table(rows, noexit, num_layers)}
