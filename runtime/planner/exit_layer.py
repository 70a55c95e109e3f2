"""The exit-layer term of the latency model: Mirror-SD's predicted speed when the early exit sits at layer L of N.

The target's layers are the same whatever L is, so a verification costs the same; L only moves the cut:

    prefix(L)  = prefix(L0) * L / L0          decoder layers are uniform (the embedding lookup is free); L0 is the
                                              layer the profile was measured at (its export's exit layer)
    arrival(L) = when the exit's message reaches the draft: prefix(L) + exit of the target's work, slowed
                 while the draft's first forward runs beside it (latency.exit_arrival_s)
    reuse(L)   = reuse_noexit + (reuse(L0) - reuse_noexit) * hit(L) / hit(L0)

A deeper exit names the target's token more often (hit(L), e.g. the trained top-4 of mirrorsd-exit-sweep)
but arrives later, leaving less of the suffix to hide the draft's first branch batch under (latency.mirror_step).
The reuse line goes through what the calibration measured: reuse without the exit head at hit 0, reuse with it at
the profile's own exit layer; in between and beyond, Mirror-SD's reuse is taken to move in proportion to the hit
rate (an assumption: two points, one line; reuse is clipped to [0, 1]).

Pure functions of numbers; ``mirrorsd plan --exit-hits`` prints the table, exit_layer_sweep.py its suggestion.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mirrorsd.runtime.planner.latency import Acceptance, SplitCosts, Strategy, exit_arrival_s, predict


@dataclass(frozen=True)
class ExitLayerRow:
    layer: int
    hit: float
    reuse: float
    gamma: int
    arrival_s: float  # when the exit's message reaches the draft, at that gamma
    step_s: float
    tokens_per_second: float


def interpolate(hits: dict[int, float], layer: int) -> float:
    """hit(layer) from a curve measured at some layers: linear between the nearest two, flat beyond the ends."""
    if not hits:
        raise ValueError("the hit-rate curve is empty")
    points = sorted(hits.items())
    if layer <= points[0][0]:
        return points[0][1]
    for (a, ha), (b, hb) in zip(points, points[1:]):
        if a <= layer <= b:
            return ha + (hb - ha) * (layer - a) / (b - a)
    return points[-1][1]


def reuse_at(hit: float, base_hit: float, reuse: float, reuse_noexit: float) -> float:
    """Mirror-SD's reuse with an exit of hit rate ``hit``, on the line through (0, reuse_noexit) and (base_hit,
    reuse) (module docstring); ``reuse`` itself when base_hit is 0 (no slope to scale)."""
    if base_hit <= 0:
        return reuse
    return min(1.0, max(0.0, reuse_noexit + (reuse - reuse_noexit) * hit / base_hit))


def at_layer(costs: SplitCosts, layer: int, base_layer: int) -> SplitCosts:
    """``costs`` with the prefix cut at ``layer`` instead of ``base_layer`` (verification unchanged)."""
    if not costs.prefix_s:
        raise ValueError(f"split {costs.split} has no prefix times (prefix_s): re-measure the profile with "
                         f"`mirrorsd devices --profile --model EXPORT`")
    return replace(costs, prefix_s=tuple(p * layer / base_layer for p in costs.prefix_s))


def exit_layer_table(costs: SplitCosts, acceptance: Acceptance, hits: dict[int, float], base_layer: int,
                     layers: list[int] | None = None, gammas: tuple[int, ...] | None = None) -> list[ExitLayerRow]:
    """Mirror-SD (exit head on) at each candidate exit layer (default: the layers of ``hits``), each at its best
    gamma; fastest first. ``acceptance.reuse`` is the reuse measured with the exit at ``base_layer``."""
    base_hit = interpolate(hits, base_layer)
    noexit = acceptance.reuse_for(False)
    gammas = gammas or tuple(range(1, costs.max_gamma + 1))
    rows = []
    for layer in layers or sorted(hits):
        hit = interpolate(hits, layer)
        reuse = reuse_at(hit, base_hit, acceptance.reuse, noexit)
        cut = at_layer(costs, layer, base_layer)
        here = replace(acceptance, reuse=reuse)
        best = max((predict(cut, Strategy("mirror", g), here) for g in gammas if g <= costs.max_gamma),
                   key=lambda p: p.tokens_per_second)
        g = best.strategy.gamma
        arrival = exit_arrival_s(cut, g)
        rows.append(ExitLayerRow(layer, hit, reuse, g, arrival, best.step_s, best.tokens_per_second))
    return sorted(rows, key=lambda r: (-round(r.tokens_per_second, 9), r.layer))


def noexit_tokens_per_second(costs: SplitCosts, acceptance: Acceptance) -> float:
    """Mirror-SD without the exit head at its best gamma: what every exit layer is compared against."""
    return max(predict(costs, Strategy("mirror", g, exit_head=False), acceptance).tokens_per_second
               for g in range(1, costs.max_gamma + 1))


def format_exit_table(rows: list[ExitLayerRow], noexit_tps: float | None = None, layers: int | None = None) -> str:
    """The table ``mirrorsd plan --exit-hits`` and exit_layer_sweep.py print, and the best layer."""
    out = ["Mirror-SD against the exit layer (PREDICTED by the latency model, not measured)", "",
           "| exit layer | hit rate | predicted reuse | exit arrives ms | gamma | step ms | predicted tok/s |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r.layer):
        name = f"{r.layer}" + (f"/{layers}" if layers else "")
        out.append(f"| {name} | {r.hit:.3f} | {r.reuse:.2f} | {r.arrival_s * 1e3:.1f} | {r.gamma} | "
                   f"{r.step_s * 1e3:.1f} | {r.tokens_per_second:.1f} |")
    best = rows[0]
    out.append(f"\nbest exit layer: {best.layer} ({best.tokens_per_second:.1f} tok/s predicted, gamma {best.gamma})"
               + (f"; mirror without the exit head: {noexit_tps:.1f}" if noexit_tps is not None else ""))
    return "\n".join(out)


def read_hits_file(path, topk: int, kind: str, fail) -> tuple[dict[int, float], int | None]:
    """read_hits of a user-named sweep file (read with a size cap, a regular file only); any problem is raised as
    ``fail(why)``."""
    from mirrorsd.user_files import JSON_LIMIT, read_json

    try:
        return read_hits(read_json(path, JSON_LIMIT, fail), topk, kind)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise fail(str(exc)) from None


def read_hits(data: dict, topk: int = 4, kind: str = "trained") -> tuple[dict[int, float], int | None]:
    """({layer: hit rate}, N) from mirrorsd-exit-sweep's --json output (top-``topk`` of the ``kind`` exit)."""
    hits = {}
    for row in data.get("results", []):
        table = row[kind]
        value = table.get(str(topk), table.get(topk))
        if value is None:
            raise ValueError(f"the sweep has no top-{topk} hit rate (it has {sorted(table)})")
        hit = float(value)
        if not 0.0 <= hit <= 1.0:  # NaN fails this too
            raise ValueError(f"layer {row['layer']}'s top-{topk} hit rate is {value!r}; a hit rate is 0..1")
        hits[int(row["layer"])] = hit
    if not hits:
        raise ValueError("the sweep lists no layer")
    return hits, data.get("layers")
