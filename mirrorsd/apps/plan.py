"""The predicted table: ``mirrorsd devices --profile``, ``mirrorsd devices --model`` and ``mirrorsd plan``.

Every number these print is a prediction of the latency model (runtime/planner/latency.py) from a profile, never a
measurement; the table says so in its title.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mirrorsd.runtime.planner.latency import Acceptance, Table, rank


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

    for flag, value in (("--alpha", alpha), ("--reuse", reuse)):
        if value is not None and not 0.0 <= value <= 1.0:  # NaN fails this too
            raise GenerationInputError(f"{flag} {value} is out of range", "it is a probability, 0..1",
                                       f"pass {flag} between 0 and 1, e.g. {flag} 0.6")
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
    from mirrorsd.runtime.planner import profile as profiles
    from mirrorsd.cli_exit import write_stdout
    from mirrorsd.errors import GenerationInputError

    acceptance_override(Acceptance(0.5, 0.5), args.alpha, args.reuse)  # the flags first: before any file is read
    for flag, value in (("--exit-topk", args.exit_topk), ("--exit-layer", args.exit_layer)):
        if value is not None and value < 1:
            raise GenerationInputError(f"{flag} {value} is out of range", "it counts from 1",
                                       f"pass {flag} 1 or more")
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
    from mirrorsd.errors import ProfileError
    from mirrorsd.runtime.planner.exit_layer import (exit_layer_table, format_exit_table, noexit_tokens_per_second,
                                                     read_hits_file)

    fix = "pass the --json output of mirrorsd-exit-sweep"
    fail = lambda why: ProfileError(f"Cannot read the exit sweep {hits_file}", why, fix)  # noqa: E731
    hits, layers = read_hits_file(hits_file, topk, kind, fail)
    out = []
    for costs, detail in zip(profile.splits, profile.detail or ({},) * len(profile.splits)):
        base = exit_layer or (detail or {}).get("exit_layer")
        if not costs.prefix_s or not base:
            out.append(f"\n{costs.split}: no exit-layer table (the split needs prefix_s, and the exit layer it was "
                       f"measured at: --exit-layer)")
            continue
        rows = exit_layer_table(costs, acceptance, hits, base)
        noexit = noexit_tokens_per_second(costs, acceptance)
        out.append(f"\n{costs.split} (exit measured at layer {base}; {kind} top-{topk} hit rates of {hits_file}):")
        out.append(format_exit_table(rows, noexit, layers or (detail or {}).get("layers")))
    return out


def splits_to_profile(threads: int | None) -> list[tuple[int, int]]:
    """The thread splits ``devices --profile`` measures on pools of their own: every core per session, and one per
    session (and, in a child process, every core on the shared pool: _measure_shared_pool)."""
    from mirrorsd.devices.backends import default_threads

    n = threads or default_threads()
    return list(dict.fromkeys([(n, n), (1, 1)]))


def devices_table(args, measure: bool) -> int:
    """``mirrorsd devices --model EXPORT [--profile]``: measure (or read) the profile of every placement the device
    flags allow here, print each one's predicted table and the placement and split mode auto would load."""
    from mirrorsd.devices.placement import DeviceRequest, placement_candidates
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime import Pipeline
    from mirrorsd.runtime.planner import loading

    from mirrorsd import ranges
    from mirrorsd.errors import GenerationInputError

    ranges.check(args, {"threads": ranges.threads()}, GenerationInputError)  # before a child builds a pool of them
    # what `mirrorsd generate --mode auto` opens: pools that spin within a run (devices/backends.py)
    request = DeviceRequest(args.target_device, args.draft_device, args.threads, args.threads, args.static_draft,
                            kernels=args.kernels, spin_in_run=True)
    if measure:
        pairs = placement_candidates(load_manifest(args.model), request)
        for pair in pairs:
            _measure_placement(args, replace(request, target=pair[0], draft=pair[1]))
        if ("cpu", "cpu") in pairs:
            _measure_shared_pool(args)
    with Pipeline.load(args.model, request) as pipe:
        here = pipe.here()
        found = loading.placement_profiles(pipe.folder, pipe.manifest, request, here)
        _, choice = loading.planned_request(pipe.folder, pipe.manifest, replace(request, plan_from_profile=True),
                                            here, found)
        tables = _cached_tables(found, here.pair)
    if not any(found.values()):
        print(f"\nNo profile of this export on this machine yet: run `mirrorsd devices --profile --model "
              f"{args.model}` (it measures each graph on each placement, about a minute each).")
        return 0
    print("\n".join(tables))
    print(f"\nMode auto loads: {choice.why}")
    return 0


def _measure_placement(args, request) -> None:
    """Profile one placement at every thread split of splits_to_profile; a placement that cannot run this export
    is reported and skipped (the others are still measured)."""
    from mirrorsd.errors import MirrorSDError
    from mirrorsd.runtime import Pipeline

    print(f"\nPlacement target {request.target}, draft {request.draft}:")
    for t, d in splits_to_profile(args.threads):
        try:
            with Pipeline.load(args.model, replace(request, target_threads=t, draft_threads=d,
                                                   shared_pool=False)) as pipe:
                pipe.profile(progress=True)
        except MirrorSDError as exc:
            print(f"  not measured: {exc.what} ({exc.why})")
            return


SHARED_CHILD = "import sys; from mirrorsd.apps.plan import profile_on_shared_pool; " \
               "profile_on_shared_pool(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == '1')"


def _measure_shared_pool(args) -> None:
    """Profile both models on ONNX Runtime's CPU provider with every core on the process's shared pool, in a child
    process: the pool is the process's, and once it exists ONNX Runtime opens no session with threads of its own
    (devices/thread_pool.py), which this process (and a library user's) may still want."""
    import subprocess
    import sys

    from mirrorsd.devices.backends import default_threads

    n = args.threads or default_threads()
    print(f"\nPlacement target cpu, draft cpu, one shared pool of {n} threads (in a child process):")
    done = subprocess.run([sys.executable, "-c", SHARED_CHILD, str(args.model), str(n), args.kernels,
                           "1" if args.static_draft else "0"], stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        print(f"  not measured: the child process failed (exit {done.returncode}; its error is above)")


def profile_on_shared_pool(model: str, threads: int, kernels: str, static_draft: bool) -> None:
    """The child of _measure_shared_pool: add the shared-pool split to the cached profile of the cpu+cpu placement."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.errors import MirrorSDError
    from mirrorsd.runtime import Pipeline

    request = DeviceRequest("cpu", "cpu", threads, threads, static_draft, kernels=kernels, shared_pool=True)
    try:
        with Pipeline.load(model, request) as pipe:
            pipe.profile(progress=True)
    except MirrorSDError as exc:
        print(f"  not measured: {exc.what} ({exc.why})")


def _cached_tables(found: dict, chain_pick: tuple[str, str]) -> list[str]:
    """The predicted table of every placement with a cached profile (``found``: loading.placement_profiles),
    ranked with the acceptance choose_placement ranks them with."""
    from mirrorsd.runtime.planner.placement import pair_name, ranking_acceptance

    out = []
    shared = ranking_acceptance(found, chain_pick)
    for pair, profile in found.items():
        name = pair_name(pair)
        if profile is None or (shared or profile.acceptance) is None:
            out.append(f"\nPlacement {name}: not measured yet")
            continue
        out.append(f"\nPlacement {name}: profile {profile.kind}, {profile.machine}, {profile.created}")
        out += [f"  {s.split}: {s.label}; contention target x{s.c_target:.2f}, draft x{s.c_draft:.2f}"
                for s in profile.splits]
        out.append(format_table(rank(list(profile.splits), shared or profile.acceptance),
                                f"Predicted speed of each mode on {name}"))
    return out
