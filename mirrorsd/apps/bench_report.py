"""Bench outputs: a markdown table, SpecBench-style answer JSON, and a PNG chart."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from mirrorsd.apps.bench import BenchResult, own_threads
from mirrorsd.apps.peers import is_peer_mode

# tok/s: new tokens / wall time of the whole call (end to end); decode tok/s: 1 / time per output token after the
# first (new tokens - 1) / (wall - time to first token)
COLUMNS = ("mode", "tok/s", "decode tok/s", "speedup", "mean accepted", "acceptance", "reuse", "overlap",
           "draft fwd/window", "parity")


def summarize_modes(result: BenchResult) -> list[dict]:
    by_mode: dict[str, list] = {}
    for run in result.runs:
        by_mode.setdefault(run.mode, []).append(run)
    base = statistics.mean(r.stats["tokens_per_second"] for r in by_mode["ar"]) if "ar" in by_mode else None
    rows = []
    for mode, runs in by_mode.items():
        tps = statistics.mean(r.stats["tokens_per_second"] for r in runs)
        mean = lambda key: statistics.mean(r.stats[key] for r in runs)  # noqa: E731
        parity = [r.parity for r in runs]
        rows.append({
            "mode": mode, "tok/s": tps, "decode tok/s": mean("decode_tokens_per_second"),
            "speedup": tps / base if base else float("nan"),
            "mean accepted": mean("mean_accepted_tokens"), "acceptance": mean("acceptance_rate"),
            "reuse": mean("reuse_rate"), "overlap": mean("overlap_ratio"),
            "draft fwd/window": mean("draft_forwards_per_window"),
            "parity": "reference" if mode == "ar" else
            f"{parity.count('identical')}/{len(parity)} identical, {parity.count('near-tie')} near-tie, "
            f"{parity.count('DIFFERENT')} different",
        })
    return rows


def _number(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"  # NaN: the peer does not report it


def markdown(result: BenchResult, command: str) -> str:
    rows = summarize_modes(result)
    lines = [f"# mirrorsd bench — {result.options.model}", "", f"Command: `{command}`", "",
             f"Machine: {result.machine}; peak RSS {result.peak_rss_mb:.0f} MiB", "",
             machine_line(result), "",
             "Prompts: " + ("the export's chat template" if result.chat else
                            "raw completion (the export has no chat template)"), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row["mode"]] + [_number(row[c]) for c in COLUMNS[1:-1]] + [row["parity"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per category (tok/s by mode):", "", "| category | " + " | ".join(r["mode"] for r in rows) + " |",
              "|---|" + "---|" * len(rows)]
    categories = list(dict.fromkeys(r.category for r in result.runs))
    for category in categories:
        cells = []
        for row in rows:
            vals = [r.stats["tokens_per_second"] for r in result.runs if r.category == category and r.mode == row["mode"]]
            cells.append(f"{statistics.mean(vals):.2f}" if vals else "-")
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines += _lookup_lines(result, categories)
    if result.latency:
        from mirrorsd.apps.latency_check import markdown_lines

        lines += markdown_lines(result.latency, result.costs.split)
    lines += terms_lines(result)
    lines += _ceiling_lines(result, rows)
    lines += _native_lines(result)
    if result.skipped:
        lines += ["", f"Skipped (prompt + max_new_tokens over the context): questions {result.skipped}"]
    flagged = [r for r in result.runs if r.parity == "DIFFERENT" and not is_peer_mode(r.mode)]
    lines += ["", f"Token parity with ar: {len(flagged)} run(s) of mirrorsd's modes differ beyond a near-tie."]
    lines += [f"- question {r.question_id} ({r.category}) mode {r.mode}" for r in flagged]
    peer_rows = [r for r in rows if is_peer_mode(r["mode"])]
    if peer_rows:
        lines += ["", "Peers ran after mirrorsd's modes, one system at a time, on the same prompt token ids, with all "
                  "cores (see `mirrorsd.apps.peers`); their parity column compares them with mirrorsd's `ar`."]
        lines += _peer_self_parity(result)
        lines += _peer_setup_lines(result)
    return "\n".join(lines) + "\n"


def _lookup_lines(result: BenchResult, categories: list[str]) -> list[str]:
    """Prompt lookup per category, from the ngram runs: the share of steps whose lookup found a window (hit rate),
    the share of copied tokens the target accepted, and the tokens each step committed."""
    runs = [r for r in result.runs if r.mode == "ngram"]
    if not runs:
        return []
    lines = ["", "Prompt lookup (mode ngram) per category:", "",
             "| category | steps | lookup hit rate | copied tokens accepted | mean accepted |", "|---|---|---|---|---|"]
    for category in [*categories, "all"]:
        chosen = [r.stats for r in runs if category in ("all", r.category)]
        if not chosen:
            continue
        steps, windows = sum(s["steps"] for s in chosen), sum(s["windows"] for s in chosen)
        drafted, accepted = sum(s["drafted"] for s in chosen), sum(s["accepted"] for s in chosen)
        lines.append(f"| {category} | {steps} | {windows / max(steps, 1):.2f} | {accepted / max(drafted, 1):.2f} | "
                     f"{(accepted + steps) / max(steps, 1):.2f} |")
    return lines


def machine_line(result: BenchResult) -> str:
    """The CPU, the flags that decide its kernels and its copy and read-only bandwidth with 1 and with all threads,
    in one line beside the table (numbers only compare between machines with these in view)."""
    cpu = result.machine.get("cpu", "unknown CPU")
    flags = result.machine.get("cpu_flags", "?")
    by_threads = {c.threads: c for c in result.ceilings}
    if by_threads:
        one, most = by_threads.get(1), max(by_threads)
        bandwidth = (f"copy bandwidth {one.bandwidth_gb_s if one else float('nan'):.1f} GB/s with 1 thread, "
                     f"{by_threads[most].bandwidth_gb_s:.1f} GB/s with {most}")
        if by_threads[most].read_gb_s:
            bandwidth += (f"; read-only stream {one.read_gb_s if one else float('nan'):.1f} GB/s with 1 thread, "
                          f"{by_threads[most].read_gb_s:.1f} GB/s with {most}")
    else:
        bandwidth = "copy bandwidth not measured in this run"
    return f"CPU: {cpu}; {result.machine.get('cpus', '?')} cores; flags: {flags}; {bandwidth}"


def terms_lines(result: BenchResult) -> list[str]:
    """The step-time model's terms from the profile's costs of the fixed modes' split (when auto ran): a window's
    verification and a draft forward in one-row target steps, the terms speculation's speed rests on."""
    costs = result.costs
    if costs is None or not costs.verify_s or costs.verify_s[0] <= 0:
        return []
    step = costs.verify_s[0]
    terms = [("target step, 1 row", step)]
    terms += [(f"verification, {w} rows", costs.verify_s[w - 1]) for w in (2, 5) if w <= len(costs.verify_s)]
    terms.append(("draft forward, 1 row", costs.draft1_s))
    lines = ["", f"Terms (the profile's costs of the {costs.split} split, in one-row target steps):", "",
             "| term | ms | target steps |", "|---|---|---|"]
    return lines + [f"| {name} | {seconds * 1e3:.1f} | {seconds / step:.2f} |" for name, seconds in terms]


def _ceiling_lines(result: BenchResult, rows: list[dict]) -> list[str]:
    """ar's decode speed against weight bytes ÷ measured bandwidth, copy and read-only (see mirrorsd.apps.bandwidth)."""
    if not result.ceilings:
        return []
    first = result.ceilings[0]
    lines = ["", f"Bandwidth ceiling (measured in this run; target weights read per decode step "
                 f"{first.weight_gb_per_token:.2f} GB, as mirrorsd's kernel streams them; a copy counts bytes read + "
                 "written, the read-only stream "
                 "bytes read, which is what a step does to its weights):", "",
             "| threads | copy bandwidth GB/s | ceiling tok/s | read-only GB/s | read ceiling tok/s | "
             "ar mode at that thread count | its decode tok/s | fraction of ceiling | fraction of read ceiling |",
             "|---|---|---|---|---|---|---|---|---|"]
    threads = own_threads(result.options)
    for ceiling in result.ceilings:
        mode = "ar" if ceiling.threads == threads else f"ar-{ceiling.threads}t"
        runs = [r for r in result.runs if r.mode == mode]
        read = ceiling.read_tokens_per_second
        if runs:
            decode = statistics.mean(r.stats["decode_tokens_per_second"] for r in runs)
            of_read = f"{decode / read:.2f}" if read else "-"
            tail = f"{mode} | {decode:.2f} | {decode / ceiling.tokens_per_second:.2f} | {of_read}"
        else:
            tail = "- | - | - | -"
        read_cells = f"{ceiling.read_gb_s:.1f} | {read:.2f}" if read else "- | -"
        lines.append(f"| {ceiling.threads} | {ceiling.bandwidth_gb_s:.1f} | {ceiling.tokens_per_second:.2f} | "
                     f"{read_cells} | {tail} |")
    return lines


def _per_step(runs: list, key: str) -> float:
    """Milliseconds per target step after the first token, summed over prompts: decode wall time ("decode") or the
    time outside graph calls ("glue": wall - target busy - draft busy, meaningful for the serial modes only)."""
    steps = sum(r.stats["steps"] for r in runs)
    if not steps:
        return float("nan")
    if key == "decode":
        total = sum(r.stats["seconds"] - r.stats["time_to_first_token_s"] for r in runs)
    else:
        total = sum(r.stats["seconds"] - r.stats["target_busy_s"] - r.stats["draft_busy_s"] for r in runs)
    return 1000 * total / steps


def _native_lines(result: BenchResult) -> list[str]:
    """The Python host against the C++ host (libmirrorsd) per decoder: the per-step overhead the C++ loop saves."""
    modes = {r.mode for r in result.runs}
    pairs = [(m[2:], m) for m in sorted(modes) if m.startswith("c-") and m[2:] in modes]
    if not pairs:
        return []
    lines = ["", "Python host vs C++ host (libmirrorsd through ctypes), same graphs, threads and prompts. ms/step = "
                 "decode wall time / target steps; glue = time outside graph calls per step (serial modes):", "",
             "| decoder | Python ms/step | C++ ms/step | saved ms/step | Python glue ms/step | C++ glue ms/step |",
             "|---|---|---|---|---|---|"]
    for py, c in pairs:
        a = [r for r in result.runs if r.mode == py]
        b = [r for r in result.runs if r.mode == c]
        pa, pb = _per_step(a, "decode"), _per_step(b, "decode")
        serial = not py.startswith("mirror")
        glue = (f"{_per_step(a, 'glue'):.2f} | {_per_step(b, 'glue'):.2f}" if serial else "- | -")
        lines.append(f"| {py} | {pa:.2f} | {pb:.2f} | {pa - pb:.2f} | {glue} |")
    return lines


def _peer_self_parity(result: BenchResult) -> list[str]:
    """A peer's speculative tokens against its own target-only tokens (the peers' own losslessness)."""
    pairs = (("hf-assisted", "hf-ar"), ("ov-sd", "ov-ar"), ("ov-user-sd", "ov-user-ar"),
             ("ov-user-sd-conf", "ov-user-ar"), ("llama-sd", "llama-ar"), ("llama-ngram", "llama-ar"))
    tokens = {(r.question_id, r.mode): r.tokens for r in result.runs}
    lines = []
    for spec, plain in pairs:
        ids = [q for (q, m) in tokens if m == spec and (q, plain) in tokens]
        if ids:
            same = sum(tokens[(q, spec)] == tokens[(q, plain)] for q in ids)
            lines.append(f"- {spec} = {plain} (its own target-only output) on {same}/{len(ids)} prompts")
    return lines


def _peer_setup_lines(result: BenchResult) -> list[str]:
    """What each peer ran with that its mode name does not say: OpenVINO's inference precision, llama.cpp's files."""
    seen: dict[str, str] = {}
    for run in result.runs:
        placement = run.stats.get("placement") or {}
        keys = ("inference_precision", "target_gguf", "draft_gguf", "server_args")
        facts = [f"{key} {placement[key]}" for key in keys if key in placement]
        if facts and is_peer_mode(run.mode):
            seen.setdefault(run.mode, ", ".join(facts))
    return [f"- {mode}: {facts}" for mode, facts in seen.items()]


def spec_bench_answers(result: BenchResult) -> list[dict]:
    answers = []
    for run in result.runs:
        answers.append({
            "question_id": run.question_id, "category": run.category, "model_id": f"mirrorsd-{run.mode}",
            "choices": [{"index": 0, "turns": [run.tokens], "new_tokens": [run.stats["new_tokens"]],
                         "wall_time": [run.stats["seconds"]], "finish_reason": [run.stats["finish_reason"]],
                         "mean_accepted_tokens": run.stats["mean_accepted_tokens"]}],
            "parity": run.parity, "tstamp": time.time()})
    return answers


def chart(result: BenchResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = summarize_modes(result)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["mode"] for r in rows], [r["speedup"] for r in rows], color="#4477aa")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for i, r in enumerate(rows):
        ax.text(i, r["speedup"], f"{r['speedup']:.2f}x\n{r['tok/s']:.1f} tok/s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("speedup over ar (same run)")
    ax.set_title(Path(str(result.options.model)).name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(result: BenchResult, command: str, folder: Path | None = None) -> dict[str, Path]:
    """Write the report files into ``folder`` (default: the options' output; the CLI passes its staged folder)."""
    out = Path(folder if folder is not None else result.options.output)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "answers": out / "answers.jsonl", "runs": out / "runs.json"}
    paths["markdown"].write_text(markdown(result, command), encoding="utf-8")
    paths["answers"].write_text("\n".join(json.dumps(a) for a in spec_bench_answers(result)) + "\n")
    paths["runs"].write_text(json.dumps([r.__dict__ for r in result.runs], indent=1))
    if result.latency:
        paths["latency"] = out / "latency_check.json"
        paths["latency"].write_text(json.dumps([{**r.__dict__, "error": round(r.error, 4)} for r in result.latency],
                                               indent=1))
    png = chart(result, out / "speedup.png")
    if png:
        paths["chart"] = png
    return paths
