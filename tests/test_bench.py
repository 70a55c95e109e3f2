"""The bench harness itself, on a tiny model: it runs, reports every mode, checks parity, writes its outputs."""
from __future__ import annotations

import json

from mirrorsd.apps.bench import BenchOptions, classify_parity, run_bench
from mirrorsd.apps.bench_report import markdown, spec_bench_answers, write_outputs


def questions(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [text, "second turn ignored"]}
            for i, (cat, text) in enumerate([("coding", "Write a loop."), ("coding", "Sort a list."),
                                             ("qa", "What is a cache?"), ("writing", "A haiku, please.")])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_bench_reports_every_mode_and_checks_parity(tmp_path, exported, monkeypatch):
    monkeypatch.setenv("MIRRORSD_PROFILES", str(tmp_path / "profiles"))  # auto's profile of this tmp export stays in tmp
    options = BenchOptions(model=exported("llama", draft_layers=3),
                           modes=("ar", "sd", "mirror", "mirror-noexit", "mirror-wide", "auto"),
                           questions=questions(tmp_path), categories=("coding", "qa"), per_category=1,
                           max_new_tokens=16, output=tmp_path / "out", warmup=False)
    result = run_bench(options, progress=False)
    assert {r.question_id for r in result.runs} == {0, 2}  # the first prompt of each asked category
    table = markdown(result, "mirrorsd bench ...")
    for mode in options.modes:
        assert f"| {mode} |" in table
    assert all(r.parity == "identical" for r in result.runs if r.mode != "ar")
    assert all(r.stats["auto"]["chosen"] for r in result.runs if r.mode == "auto")  # what auto ran, and why
    assert "0 run(s) of mirrorsd's modes differ" in table
    assert result.ceilings and all(c.bandwidth_gb_s > 0 and c.tokens_per_second > 0 and c.read_gb_s > 0
                                   for c in result.ceilings)
    assert "Bandwidth ceiling" in table and "| ar |" in table.split("Bandwidth ceiling")[1]
    checked = {r.mode: r for r in result.latency}  # auto ran, so its profile checks the fixed modes' predictions
    took_mirror = [any(name.startswith("mirror") for name in [r.stats["auto"]["chosen"], r.stats["auto"]["final"]]
                       + [s["new"] for s in r.stats["auto"]["switches"]]) for r in result.runs if r.mode == "auto"]
    assert set(checked) == {"ar", "sd", "mirror", "mirror-noexit"} | ({"auto"} if not all(took_mirror) else set())
    assert all(r.prompts == 2 and r.predicted > 0 and r.measured > 0 for m, r in checked.items() if m != "auto")
    assert "auto" not in checked or checked["auto"].prompts == took_mirror.count(False)
    assert "Latency model vs this run" in table and "| sd | 2 |" in table.split("Latency model vs this run")[1]
    assert "| target step, 1 row |" in table.split("Terms (the profile's costs")[1]  # auto ran: a profile's terms
    paths = write_outputs(result, "cmd")
    assert {r["mode"] for r in json.loads(paths["latency"].read_text())} == set(checked)
    answers = [json.loads(line) for line in paths["answers"].read_text().splitlines()]
    assert len(answers) == 2 * len(options.modes) and all(a["choices"][0]["new_tokens"][0] > 0 for a in answers)
    for a in answers:  # why each answer ended: the token budget, or an EOS token before it
        choice = a["choices"][0]
        assert choice["finish_reason"][0] in ("eos", "length")
        assert (choice["finish_reason"][0] == "length") == (choice["new_tokens"][0] == options.max_new_tokens)
    assert paths["markdown"].is_file() and (paths.get("chart") is None or paths["chart"].stat().st_size > 0)
    assert len(spec_bench_answers(result)) == len(result.runs)


def test_parity_classification():
    assert classify_parity([1, 2, 3], [1, 2, 3], [5.0] * 3) == "identical"
    assert classify_parity([1, 2, 3], [1, 9, 3], [5.0, 1e-4, 5.0]) == "near-tie"
    assert classify_parity([1, 2, 3], [1, 9, 3], [5.0, 0.5, 5.0]) == "DIFFERENT"
    assert classify_parity([1, 2, 3], [1, 2], [5.0] * 3) == "DIFFERENT"


def test_bench_runs_transformers_peers_on_the_same_prompt_ids(tmp_path, exported, tiny_model):
    """hf-ar and hf-assisted (transformers assisted generation) on the export's own source folders: greedy, so they
    must emit mirrorsd's ar tokens (up to near-ties); a failing peer load or a different prompt would show here."""
    folder = exported("llama", draft=tiny_model("llama", layers=2, seed=1))
    options = BenchOptions(model=folder, modes=("ar", "sd", "hf-ar", "hf-assisted"), questions=questions(tmp_path),
                           categories=("coding", "qa"), per_category=1, max_new_tokens=12,
                           output=tmp_path / "out", warmup=False, bandwidth=False)
    result = run_bench(options, progress=False)
    peers = [r for r in result.runs if r.mode.startswith("hf-")]
    assert sorted((r.question_id, r.mode) for r in peers) == [(0, "hf-ar"), (0, "hf-assisted"), (2, "hf-ar"),
                                                              (2, "hf-assisted")]
    assert all(r.parity in ("identical", "near-tie") for r in peers), [(r.mode, r.parity) for r in peers]
    assert all(r.stats["new_tokens"] == len(r.tokens) > 0 and r.stats["tokens_per_second"] > 0 for r in peers)
    table = markdown(result, "cmd")
    assert "| hf-assisted |" in table and "hf-assisted = hf-ar (its own target-only output) on" in table


def test_peer_modes_fail_clearly_without_hf_sources(tmp_path, exported):
    from mirrorsd.apps.peers import PeerUnavailableError

    options = BenchOptions(model=exported("llama", draft_layers=3), modes=("ar", "hf-ar"),
                           questions=questions(tmp_path), categories=("qa",), per_category=1, max_new_tokens=4,
                           output=tmp_path / "out", warmup=False, bandwidth=False, peer_target=tmp_path / "nowhere")
    try:
        run_bench(options, progress=False)
    except PeerUnavailableError as exc:
        assert "--peer-target" in str(exc)
    else:
        raise AssertionError("a missing peer folder must raise PeerUnavailableError")


def test_bench_runs_openvino_genai_peers(tmp_path, exported, tiny_model, monkeypatch):
    """ov-ar / ov-sd: optimum-intel converts the tiny source folders, OpenVINO GenAI runs them on CPU (f32).
    Skipped where the peers extra is not installed (CI installs it not: bash scripts/setup.sh --peers)."""
    import pytest

    pytest.importorskip("openvino_genai")
    pytest.importorskip("optimum.intel")
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    folder = exported("llama", draft=tiny_model("llama", layers=2, seed=1))
    options = BenchOptions(model=folder, modes=("ar", "ov-ar", "ov-sd"), questions=questions(tmp_path),
                           categories=("coding",), per_category=1, max_new_tokens=8,
                           output=tmp_path / "out", warmup=False)
    result = run_bench(options, progress=False)
    runs = {r.mode: r for r in result.runs}
    assert len(runs["ov-ar"].tokens) > 0 and len(runs["ov-sd"].tokens) > 0
    for mode in ("ov-ar", "ov-sd"):  # the label follows the tokens: "identical" exactly when they are ar's
        assert (runs[mode].parity == "identical") == (runs[mode].tokens == runs["ar"].tokens), mode
    # f32 target-only greedy decoding of the same source model: ar's tokens up to near-ties (ov-sd may differ: a
    # finding the report states, not a failure)
    assert runs["ov-ar"].parity in ("identical", "near-tie"), runs["ov-ar"].parity
    assert "ov-sd = ov-ar (its own target-only output) on" in markdown(result, "cmd")


def test_bench_runs_the_native_host_beside_python(tmp_path, exported, native_build):
    """c-* modes: libmirrorsd's decoders on the same prompt ids, rotated with the Python modes; parity against ar and
    the Python-vs-C++ per-step table in the report."""
    options = BenchOptions(model=exported("llama", draft_layers=3), modes=("ar", "sd", "c-ar", "c-sd", "c-mirror"),
                           questions=questions(tmp_path), categories=("coding",), per_category=1, max_new_tokens=12,
                           output=tmp_path / "out", warmup=True, bandwidth=False,
                           native_library=native_build.library)
    result = run_bench(options, progress=False)
    native = {r.mode: r for r in result.runs if r.mode.startswith("c-")}
    assert sorted(native) == ["c-ar", "c-mirror", "c-sd"]
    assert all(r.parity == "identical" and r.stats["placement"]["host"] == "libmirrorsd (C++)"
               for r in native.values())
    assert native["c-sd"].stats["steps"] == next(r for r in result.runs if r.mode == "sd").stats["steps"]
    section = markdown(result, "cmd").split("Python host vs C++ host")[1]
    assert "| ar |" in section and "| sd |" in section and "| mirror |" not in section  # no Python mirror here


def test_bench_runs_auto_with_the_thread_split_its_profile_chooses(tmp_path, exported, monkeypatch):
    """Without --threads, mode auto gets its own pipeline with the split the cached profile predicts fastest (here
    1+1), while ar keeps every core; auto still emits ar's tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_auto import cache_profile, cores, split_costs

    monkeypatch.setenv("MIRRORSD_PROFILES", str(tmp_path / "profiles"))
    folder = exported("llama", draft_layers=4)
    n = cores()
    cache_profile(folder, [split_costs(n, n, 0.009, 0.004, 2.0), split_costs(1, 1, 0.010, 0.001)], alpha=0.9)
    options = BenchOptions(model=folder, modes=("ar", "auto"), questions=questions(tmp_path), categories=("coding",),
                           per_category=1, max_new_tokens=16, output=tmp_path / "out", warmup=False, bandwidth=False)
    result = run_bench(options, progress=False)
    auto = [r for r in result.runs if r.mode == "auto"]
    assert auto and all(r.parity == "identical" for r in auto)
    assert all(r.stats["auto"]["threads"]["chosen"] == "1+1" for r in auto), auto[0].stats["auto"]["threads"]


def test_latency_check_prices_each_run_from_its_own_acceptance():
    """Hand-computed predictions: ar is one row; sd at alpha 0.5 and gamma 2 commits 1.75 tokens per step of two
    draft forwards and a 3-row verify; ngram's windows are priced at their mean width."""
    from types import SimpleNamespace

    from mirrorsd.apps.latency_check import check, markdown_lines, predicted_tps
    from mirrorsd.runtime.planner.latency import SplitCosts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.010, 0.011, 0.012, 0.014), exit_s=(0.0,) * 4,
                       draft1_s=0.005, branch_fwd_s=0.006, branch_batch=2)
    assert predicted_tps(costs, "ar", {"steps": 10}, 4) == 100.0
    sd = {"steps": 10, "mean_accepted_tokens": 1.75, "reuse_rate": 0.0}
    assert abs(predicted_tps(costs, "sd", sd, 2) - 1.75 / (2 * 0.005 + 0.012)) < 1e-6
    ngram = {"steps": 10, "windows": 4, "drafted": 10, "accepted": 6}  # windows of 2.5 tokens, 16 tokens committed
    assert abs(predicted_tps(costs, "ngram", ngram, 4) - 16 / (6 * 0.010 + 4 * 0.013)) < 1e-9
    assert predicted_tps(costs, "sd", {"steps": 0}, 2) is None
    # sd's draft prefill of the prompt (draft_prefill_s per token) is spread over the run's steps: 10 prompt tokens
    # at 1 ms, 7 new tokens = 4 steps of 1.75 tokens -> 0.010 s over 4 steps
    prefill = SplitCosts(**{**costs.__dict__, "draft_prefill_s": 0.001})
    short = {**sd, "prompt_tokens": 10, "new_tokens": 7}
    assert abs(predicted_tps(prefill, "sd", short, 2) - 1.75 / (2 * 0.005 + 0.012 + 0.010 / 4)) < 1e-6
    stop = {"steps": 10, "windows": 10, "drafted": 15, "draft_forwards": 15, "accepted": 9, "prompt_tokens": 10}
    assert abs(predicted_tps(prefill, "sd-stop", stop, 4) - 19 / (5 * 0.011 + 5 * 0.012 + 15 * 0.005 + 0.010)) < 1e-9
    assert predicted_tps(prefill, "sd-stop-ngram", stop, 4) == predicted_tps(prefill, "sd-stop", stop, 4)
    # auto: priced by its steps like sd-stop, whatever took them; not when it ran Mirror-SD or another split
    plan = {"chosen": "sd-stop0.8 g4 2+2", "final": "ngram g4 2+2", "switches": [], "split": "2+2"}
    assert predicted_tps(prefill, "auto", {**stop, "auto": plan}, 4) == predicted_tps(prefill, "sd-stop", stop, 4)
    stayed_ar = {**stop, "windows": 0, "drafted": 0, "draft_forwards": 0, "accepted": 0, "auto": plan}
    assert predicted_tps(prefill, "auto", stayed_ar, 4) == 100.0  # no draft forward: no draft prefill either
    switched = {**plan, "switches": [{"new": "mirror g2 2+2"}]}
    assert predicted_tps(prefill, "auto", {**stop, "auto": switched}, 4) is None
    assert predicted_tps(prefill, "auto", {**stop, "auto": {**plan, "split": "1+1"}}, 4) is None

    def run(mode, decode, **stats):
        return SimpleNamespace(mode=mode, stats={"decode_tokens_per_second": decode, **stats})

    rows = check(costs, [run("ar", 80.0, steps=5), run("ar", 100.0, steps=5), run("sd", 100.0, **sd),
                         run("auto", 1.0, steps=5, auto={"chosen": "mirror g2 2+2"})], 2)
    assert [(r.mode, r.prompts) for r in rows] == [("ar", 2), ("sd", 1)]
    assert abs(rows[0].error - (-0.10)) < 1e-9 and rows[1].error > 0.2
    text = "\n".join(markdown_lines(rows, "2+2"))
    assert "| ar | 2 | 100.00 | 90.00 | -10% |" in text and "(outside)" in text.split("| sd |")[1]
    # auto on its own pipeline is priced with that pipeline's split, and the table says which
    shared = SplitCosts(**{**costs.__dict__, "shared_pool": True, "verify_s": (0.005, 0.006, 0.007, 0.008)})
    own = {"steps": 4, "windows": 0, "drafted": 0, "accepted": 0, "auto": {"chosen": "ar 2 shared", "final":
           "ar 2 shared", "switches": [], "split": shared.split}}
    rows = check(costs, [run("auto", 150.0, **own)], 2, auto_costs=shared)
    assert [(r.mode, r.split, r.predicted) for r in rows] == [("auto", "2 shared", 200.0)]
    assert "| auto (2 shared) | 1 | 200.00 | 150.00 | -25% (outside) |" in "\n".join(markdown_lines(rows, "2+2"))
    assert check(costs, [run("auto", 150.0, **own)], 2) == []  # its split's costs not given: not priced


def test_the_report_gives_the_step_time_terms_in_target_steps():
    """The profile's verification of 2 and 5 rows and its draft forward, in one-row target steps; nothing without a
    profile (auto did not run) and no 5-row line when the profile stops at 4 rows."""
    from types import SimpleNamespace

    from mirrorsd.apps.bench_report import terms_lines
    from mirrorsd.runtime.planner.latency import SplitCosts

    costs = SplitCosts(target_threads=2, draft_threads=2, verify_s=(0.040, 0.044, 0.048, 0.050, 0.054),
                       exit_s=(0.0,) * 5, draft1_s=0.014, branch_fwd_s=0.016, branch_batch=2)
    text = "\n".join(terms_lines(SimpleNamespace(costs=costs)))
    assert "of the 2+2 split" in text
    assert "| target step, 1 row | 40.0 | 1.00 |" in text
    assert "| verification, 2 rows | 44.0 | 1.10 |" in text
    assert "| verification, 5 rows | 54.0 | 1.35 |" in text
    assert "| draft forward, 1 row | 14.0 | 0.35 |" in text
    assert terms_lines(SimpleNamespace(costs=None)) == []
    short = SplitCosts(**{**costs.__dict__, "verify_s": costs.verify_s[:4], "exit_s": costs.exit_s[:4]})
    assert "5 rows" not in "\n".join(terms_lines(SimpleNamespace(costs=short)))
