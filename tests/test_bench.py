"""The bench harness itself, on a tiny model: it runs, reports every mode, checks parity, writes its outputs."""
from __future__ import annotations

import json

from mirrorsd.bench import BenchOptions, classify_parity, run_bench
from mirrorsd.bench_report import markdown, spec_bench_answers, write_outputs


def questions(tmp_path):
    rows = [{"question_id": i, "category": cat, "turns": [text, "second turn ignored"]}
            for i, (cat, text) in enumerate([("coding", "Write a loop."), ("coding", "Sort a list."),
                                             ("qa", "What is a cache?"), ("writing", "A haiku, please.")])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_bench_reports_every_mode_and_checks_parity(tmp_path, exported):
    options = BenchOptions(model=exported("llama", draft_layers=3), modes=("ar", "sd", "mirror", "mirror-noexit"),
                           questions=questions(tmp_path), categories=("coding", "qa"), per_category=1,
                           max_new_tokens=16, output=tmp_path / "out", warmup=False)
    result = run_bench(options, progress=False)
    assert {r.question_id for r in result.runs} == {0, 2}  # the first prompt of each asked category
    table = markdown(result, "mirrorsd bench ...")
    for mode in options.modes:
        assert f"| {mode} |" in table
    assert all(r.parity == "identical" for r in result.runs if r.mode != "ar")
    assert "0 run(s) differ" in table
    paths = write_outputs(result, "cmd")
    answers = [json.loads(line) for line in paths["answers"].read_text().splitlines()]
    assert len(answers) == 2 * len(options.modes) and all(a["choices"][0]["new_tokens"][0] > 0 for a in answers)
    assert paths["markdown"].is_file() and (paths.get("chart") is None or paths["chart"].stat().st_size > 0)
    assert len(spec_bench_answers(result)) == len(result.runs)


def test_parity_classification():
    assert classify_parity([1, 2, 3], [1, 2, 3], [5.0] * 3) == "identical"
    assert classify_parity([1, 2, 3], [1, 9, 3], [5.0, 1e-4, 5.0]) == "near-tie"
    assert classify_parity([1, 2, 3], [1, 9, 3], [5.0, 0.5, 5.0]) == "DIFFERENT"
    assert classify_parity([1, 2, 3], [1, 2], [5.0] * 3) == "DIFFERENT"
