"""The predicted table: ``mirrorsd devices --profile``, ``mirrorsd devices --model`` and ``mirrorsd plan``.

Every number these print is a prediction of the latency model (runtime/latency.py) from a profile, never a
measurement; the table says so in its title.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from mirrorsd.runtime.latency import Acceptance, Table, rank


def summary_rows(table: Table) -> list:
    """Per split: ar, and the best sd, mirror and mirror without the exit head (each at its best gamma)."""
    rows, splits = [], list(dict.fromkeys(r.strategy.split for r in table.rows))
    for split in splits:
        for mode, exit_head in (("ar", None), ("sd", None), ("mirror", True), ("mirror", False)):
            best = next((r for r in table.rows if r.strategy.split == split and r.strategy.mode == mode
                         and (exit_head is None or r.strategy.exit_head == exit_head)), None)
            if best is not None:
                rows.append(best)
    return sorted(rows, key=lambda r: -r.tokens_per_second)


def format_table(table: Table, title: str) -> str:
    a = table.acceptance
    reuse_noexit = a.reuse if a.reuse_noexit is None else a.reuse_noexit
    ar = max((r.tokens_per_second for r in table.rows if r.strategy.mode == "ar"), default=0.0)
    lines = [f"{title} (PREDICTED by the latency model, not measured)",
             f"acceptance: alpha {a.alpha:.3f} per token, mirror reuse {a.reuse:.2f} with the exit head, "
             f"{reuse_noexit:.2f} without ({a.source})", "",
             "| strategy | placement or threads (target+draft) | step ms | tokens/step | predicted tok/s | x best ar |",
             "|---|---|---:|---:|---:|---:|"]
    for r in summary_rows(table):
        s = r.strategy
        label = s.name.rsplit(" ", 1)[0]
        lines.append(f"| {label} | {s.split} | {r.step_s * 1e3:.1f} | {r.tokens_per_step:.2f} | "
                     f"{r.tokens_per_second:.1f} | {r.tokens_per_second / ar if ar else 0:.2f} |")
    best = table.best
    lines.append(f"\nfastest: {best.strategy.name} ({best.tokens_per_second:.1f} tok/s predicted)")
    return "\n".join(lines)


def acceptance_override(base: Acceptance | None, alpha: float | None, reuse: float | None) -> Acceptance:
    from mirrorsd.errors import GenerationInputError

    if base is None and alpha is None:
        raise GenerationInputError("The profile has no acceptance statistics", "the table needs the pair's alpha",
                                   "pass --alpha (and --reuse), or measure the profile with --profile")
    base = base or Acceptance(alpha, reuse if reuse is not None else 0.0, None, "given")
    if alpha is not None or reuse is not None:
        base = replace(base, alpha=base.alpha if alpha is None else alpha,
                       reuse=base.reuse if reuse is None else reuse,
                       reuse_noexit=base.reuse_noexit if reuse is None else reuse, source="given")
    return base


def plan_command(args) -> int:
    """``mirrorsd plan --profile FILE``: the predicted table of a (hand-written) profile."""
    from mirrorsd import profile as profiles
    from mirrorsd.cli_exit import write_stdout

    profile = profiles.load(args.profile)
    acceptance = acceptance_override(profile.acceptance, args.alpha, args.reuse)
    table = rank(list(profile.splits), acceptance)
    out = [f"Profile {args.profile}: {profile.kind}, {profile.machine}"]
    out += [f"  {s.split}: {s.label}" for s in profile.splits]
    out += [f"  source: {src}" for src in profile.sources]
    out.append("")
    out.append(format_table(table, "Predicted speed"))
    if args.exit_hits is not None:
        out += exit_layer_lines(profile, acceptance, args.exit_hits, args.exit_topk, args.exit_layer, args.exit_kind)
    write_stdout("\n".join(out) + "\n")
    return 0


def exit_layer_lines(profile, acceptance: Acceptance, hits_file: Path, topk: int, exit_layer: int | None,
                     kind: str = "trained") -> list[str]:
    """Per thread split with prefix times: Mirror-SD's predicted speed at each exit layer of the sweep."""
    import json

    from mirrorsd.errors import ProfileError
    from mirrorsd.runtime.exit_layer import exit_layer_table, format_exit_table, read_hits
    from mirrorsd.runtime.latency import Strategy, predict

    try:
        hits, layers = read_hits(json.loads(Path(hits_file).read_text()), topk, kind)
    except (OSError, ValueError, KeyError) as exc:
        raise ProfileError(f"Cannot read the exit sweep {hits_file}", str(exc),
                           "pass the --json output of scripts/exit_layer_sweep.py") from None
    out = []
    for costs, detail in zip(profile.splits, profile.detail or ({},) * len(profile.splits)):
        base = exit_layer or (detail or {}).get("exit_layer")
        if not costs.prefix_s or not base:
            out.append(f"\n{costs.split}: no exit-layer table (the split needs prefix_s, and the exit layer it was "
                       f"measured at: --exit-layer)")
            continue
        rows = exit_layer_table(costs, acceptance, hits, base)
        noexit = max(predict(costs, Strategy("mirror", g, exit_head=False), acceptance).tokens_per_second
                     for g in range(1, costs.max_gamma + 1))
        out.append(f"\n{costs.split} (exit measured at layer {base}; {kind} top-{topk} hit rates of {hits_file}):")
        out.append(format_exit_table(rows, noexit, layers or (detail or {}).get("layers")))
    return out


def splits_to_profile(threads: int | None) -> list[tuple[int, int]]:
    """The thread splits ``devices --profile`` measures: every core per session, and one per session."""
    n = threads or max(1, os.cpu_count() or 1)
    return list(dict.fromkeys([(n, n), (1, 1)]))


def devices_table(args, measure: bool) -> int:
    """``mirrorsd devices --model EXPORT [--profile]``: measure (or read) the profile, print the predicted table."""
    from mirrorsd import profile as profiles
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.profiling import profile_for

    profile = None
    for t, d in (splits_to_profile(args.threads) if measure else [(args.threads, args.threads)]):
        request = DeviceRequest(args.target_device, args.draft_device, t, d, args.static_draft, kernels=args.kernels)
        with Pipeline.load(args.model, request) as pipe:
            if measure:
                profile = profile_for(pipe, progress=True)
                continue
            path = profiles.cache_path(pipe.folder, {role: p.describe() for role, p in pipe.placements.items()})
            if not path.is_file():
                print(f"\nNo profile of this export on this device set yet: run `mirrorsd devices --profile "
                      f"--model {args.model}` (it measures each graph, seconds to a minute).")
                return 0
            profile = profiles.load(path)
    path = profiles.cache_path(Path(args.model), {})  # for the message only: the folder's cache family
    print(f"\nProfile ({profile.kind}, {profile.machine}, {profile.created}; cached under {path.parent})")
    for s in profile.splits:
        print(f"  {s.split}: {s.label}; contention target x{s.c_target:.2f}, draft x{s.c_draft:.2f}")
    table = rank(list(profile.splits), profile.acceptance)
    print(format_table(table, "\nPredicted speed of each mode on this machine"))
    return 0
