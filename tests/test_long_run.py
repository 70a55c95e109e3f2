"""Long generations: 10,000 tokens in ar and mirror with flat memory after warm-up, and per-token costs on the
Python side that do not grow with the length (streaming text included).

The draft runs where auto puts it and, explicitly, on OpenVINO's CPU plugin (whose per-shape kernel cache once
grew by gigabytes; see devices/backends.py). The 10k-token runs use a tiny 2-layer model with 10,240 positions whose manifest lists no EOS id, so nothing stops
them early; its draft is the model itself, so that mirror commits five tokens a step and the run takes minutes,
not a quarter of an hour, on two cores. Memory is the RSS (psutil) of a fresh process that runs only these
generations, at 1k, 5k and 10k tokens; a warm-up run first lets ONNX Runtime's arena and the allocator reach the
sizes a 10k context needs, then a second run must stay within what its KV caches legitimately add. The numbers are
printed (pytest -s) for the record.
"""
from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mirrorsd.runtime.text import StreamDecoder

from markers import needs_openvino
from tiny_models import build_model

MARKS = (1_000, 5_000, 10_000)
NEW = 10_000
PROMPT = [1, 17, 42, 99, 7]
MiB = 2**20


# ---- streaming text --------------------------------------------------------------------------------------------
class Codec:
    """The one method StreamDecoder uses, over any ``tokenizers`` Tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def sentencepiece_like():
    """Llama-style decoding: '▁' is a space, <0xNN> tokens are bytes, and the first leading space is dropped."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "<s>", "▁Hello", "▁world", "ing", "▁", "!", "\n", "▁caf", "é"]
    pieces += [f"<0x{b:02X}>" for b in (0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.add_special_tokens(["<s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, len(pieces)


@pytest.fixture(scope="module")
def codecs(tiny_model):
    from tokenizers import Tokenizer

    byte_level = Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))
    sp, sp_vocab = sentencepiece_like()
    return {"byte-level": (Codec(byte_level), byte_level.get_vocab_size()), "sentencepiece": (Codec(sp), sp_vocab)}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["byte-level", "sentencepiece"]), st.lists(st.integers(0, 10_000), max_size=60),
       st.lists(st.integers(1, 4), min_size=1, max_size=60))
def test_stream_pieces_add_up_to_the_text(codecs, which, raw_ids, chunks):
    """However ids arrive, the pieces join to the full decode (up to a trailing incomplete character)."""
    codec, vocab = codecs[which]
    ids = [i % vocab for i in raw_ids]
    stream, pieces, at = StreamDecoder(codec), [], 0
    for size in chunks * (len(ids) // len(chunks) + 1):
        if at >= len(ids):
            break
        pieces.append(stream.push(ids[at:at + size]))
        at += size
    full, joined = codec.decode(ids), "".join(pieces)
    assert "\ufffd" not in joined[-1:]
    # The full decode, except where it shows replacement characters: a byte-fallback decoder renders a run of byte
    # tokens that is not valid UTF-8 as a whole (e.g. E2 82 82 E2: U+2082 then an unfinished character) as one U+FFFD
    # per byte, while the stream already printed the valid character before the run broke. Text outside those runs
    # must match exactly; an unfinished character at the end (and the push that brought it) is withheld.
    if not full.endswith("\ufffd"):
        assert matches_outside_replacements(joined, full), (joined, full)
    else:
        assert any(matches_outside_replacements(joined, codec.decode(ids[:k])) for k in range(len(ids))), (joined, full)


def matches_outside_replacements(text: str, decoded: str) -> bool:
    pattern = "".join(".*?" if part.startswith("\ufffd") else re.escape(part)
                      for part in re.split("(\ufffd+)", decoded) if part)
    return re.fullmatch(pattern, text, flags=re.S) is not None


def test_stream_cost_per_token_does_not_grow(codecs):
    """Pushing the 10,000th token costs about what pushing the 1,000th did (no decode of everything each time)."""
    codec, vocab = codecs["byte-level"]
    ids = np.random.default_rng(0).integers(3, vocab, NEW).tolist()
    stream, block_seconds = StreamDecoder(codec), []
    for start in range(0, NEW, 1000):
        began = time.perf_counter()
        for token in ids[start:start + 1000]:
            stream.push([token])
        block_seconds.append(time.perf_counter() - began)
    print(f"\nstream push, ms per token by 1k block: {[round(s, 3) for s in block_seconds]}")
    assert min(block_seconds[-3:]) < 3 * max(block_seconds[:3]) + 0.05


# ---- 10,000 tokens ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """A tiny 2-layer model with 10,240 positions, exported with itself as the draft; its manifest lists no EOS."""
    from mirrorsd.export.pipeline import ExportOptions, export

    root = tmp_path_factory.mktemp("long")
    model = build_model(root / "hf", "llama", layers=2, max_positions=10_240)
    out = root / "export"
    export(ExportOptions(model=model, output=out, draft_layers=2))  # all of its layers
    manifest = out / "mirrorsd.json"
    data = json.loads(manifest.read_text())
    data["tokenizer"]["eos_token_ids"] = []  # the random model may well emit EOS: it must not stop the run
    manifest.write_text(json.dumps(data))
    return out


def kv_bytes_per_token(manifest, model: str) -> int:
    info = manifest.target if model == "target" else manifest.draft
    return info.num_layers * 2 * info.num_kv_heads * info.head_dim * 4  # keys + values, float32


def run(pipe, mode: str):  # mirror with one batch of two branches a step: the cheapest concurrent setting
    """One 10k-token generation: tokens, RSS at each mark, and (tokens, wall, target busy) samples per step."""
    import psutil

    from mirrorsd.runtime import GenerationConfig

    process, rss, samples = psutil.Process(), {}, []
    busy = [0, 0.0]  # intervals summed so far, their total: summing all of them per step would be quadratic

    def on_text(piece: str) -> None:
        n = pipe.target.length + 1 - len(PROMPT)  # tokens generated so far (give or take a window)
        intervals = pipe.target_timeline.intervals
        busy[1] += sum(end - start for start, end in intervals[busy[0]:])
        busy[0] = len(intervals)
        samples.append((n, time.perf_counter(), busy[1]))
        for mark in MARKS:
            if n >= mark and mark not in rss:
                rss[mark] = process.memory_info().rss

    out = pipe.generate(PROMPT, GenerationConfig(mode=mode, max_new_tokens=NEW, branches=2), on_text=on_text)
    rss.setdefault(NEW, process.memory_info().rss)
    return out, rss, np.array(samples)


def python_ms_per_token(samples: np.ndarray, lo: int, hi: int) -> float:
    """Wall time not spent inside the target's graphs, per token, between ``lo`` and ``hi`` tokens (ar only)."""
    rows = samples[(samples[:, 0] >= lo) & (samples[:, 0] <= hi)]
    (n0, t0, b0), (n1, t1, b1) = rows[0], rows[-1]
    return ((t1 - t0) - (b1 - b0)) / (n1 - n0) * 1e3


def check_flat(mode: str, pipe, warm, warm_rss, out, rss, per_token, report) -> bool:
    """Whether a run after the warm-up added between 1k and 10k tokens only what its KV caches legitimately need."""
    for result in (warm, out):
        assert len(result.tokens) == NEW and not result.stats.draft_failures
    # the target's KV slots; in mirror the draft's main cache, its doubling, and the branch copies alive at once
    # (2 rows + main)
    kv = per_token["target"] * (MARKS[-1] - MARKS[0])
    if mode == "mirror":
        kv += 4 * per_token["draft"] * MARKS[-1]
    allowed = kv + 12 * MiB  # Python objects of the run's statistics, allocator slack
    growth = rss[MARKS[-1]] - rss[MARKS[0]]
    report.append(f"{mode:6s} draft on {pipe.placements['draft'].describe()}: warm-up RSS "
                  f"{[round(warm_rss[m] / MiB, 1) for m in MARKS]} MiB, measured "
                  f"{[round(rss[m] / MiB, 1) for m in MARKS]} MiB: +{growth / MiB:.1f} MiB from 1k to 10k "
                  f"(allowed {allowed / MiB:.1f}), {out.stats.seconds:.0f} s, "
                  f"{out.stats.mean_accepted_tokens:.2f} tokens/step")
    return growth <= allowed


def leaks_across_runs(pipe, mode: str, rss: dict, reference: list, report: list, repeats: int = 2,
                      allowed: int = 12 * MiB) -> bool:
    """Whether each of ``repeats`` more identical runs ends 10k tokens more than ``allowed`` above the run before."""
    before = rss[MARKS[-1]]
    for _ in range(repeats):
        again, again_rss, _ = run(pipe, mode)
        assert again.tokens == reference
        across = again_rss[MARKS[-1]] - before
        report.append(f"       repeated run: RSS at 10k {again_rss[MARKS[-1]] / MiB:.1f} MiB, "
                      f"{across / MiB:+.1f} MiB against the run before (allowed +{allowed / MiB:.1f})")
        if across <= allowed:
            return False
        before = again_rss[MARKS[-1]]
    return True


# With the draft on OpenVINO's CPU plugin, RSS once kept growing from one 10k-token run to the next (1732 -> 2073 ->
# 2517 MiB at 10k): glibc kept the buffers the plugin frees at every new input shape resident. Its sessions now trim
# the heap every few calls (devices/heap.py; docs/reliability.md has the numbers).


def flat_memory_report(folder, draft: str) -> str:
    """ar and mirror over 10k tokens each (warm-up + measured) with the draft on ``draft``; AssertionError when the
    memory is not flat or the tokens differ; else the report. Runs in a fresh process (the test below)."""
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime import Pipeline

    report, reference = [], None
    # One thread per session: what this test measures is the caches' growth with the context, and with 2 + 2
    # threads on 2 cores the allocator's per-thread slack differs by machine. CI's Intel CPU (AVX-512, AMX) measured
    # +42 MiB (ORT draft, allowed 36) and +196 MiB (OpenVINO CPU draft) from 1k to 10k tokens that way, while this
    # AMD CPU stayed inside the allowance; docs/reliability.md records it as open.
    request = DeviceRequest(target="cpu" if draft != "auto" else "auto", draft=draft, target_threads=1, draft_threads=1)
    with Pipeline.load(folder, request) as pipe:
        assert draft == "auto" or pipe.placements["draft"].effective == "CPU"  # OpenVINO compiled it for its CPU
        per_token = {m: kv_bytes_per_token(pipe.manifest, m) for m in ("target", "draft")}
        for mode in ("ar", "mirror"):
            warm, warm_rss, _ = run(pipe, mode)  # warm-up: the arena grows to what a 10k context needs
            out, rss, samples = run(pipe, mode)
            reference = reference or warm.tokens
            assert warm.tokens == out.tokens == reference  # mirror equals ar over all 10k tokens
            if not check_flat(mode, pipe, warm, warm_rss, out, rss, per_token, report):
                # Over the allowance inside one run: a leak, or ONNX Runtime's CPU arena extending late in the run
                # (it grows by the next power of two of what it holds, and a later run reuses the region). A leak
                # grows again in every identical run; an arena extension or the allocator's slack does not. Up to two
                # more runs: one of them must add at most 12 MiB at 10k to the run before it, so a leak of more than
                # 12 MiB per 10k tokens (1.2 KiB a token) fails. (One repeat once measured +12.4 MiB on CI's CPU.)
                assert not leaks_across_runs(pipe, mode, rss, reference, report), "\n".join(report)
            if mode == "ar":
                early, late = python_ms_per_token(samples, 1_000, 2_000), python_ms_per_token(samples, 9_000, NEW)
                report.append(f"       python-side ms/token: {early:.3f} at 1k-2k, {late:.3f} at 9k-10k")
                assert late < 3 * early + 1.0, report[-1]
    return "\n".join(report)


CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from test_long_run import flat_memory_report; " \
        "print(flat_memory_report(sys.argv[2], sys.argv[3]))"


# auto: the draft where auto puts it; openvino:CPU: the draft forced onto OpenVINO's CPU plugin (auto does not pick
# it, so it is asked for by name and runs on every machine). Each in a fresh process: RSS then measures this test's
# runs, not the heap the suite's earlier tests fragmented (in a full run the ORT draft's repeated mirror runs once
# grew +40 MiB each, in the same process where every run alone stayed within a few MiB).
@pytest.mark.slow  # a few minutes on two cores
@pytest.mark.parametrize("draft", ["auto", pytest.param("openvino:CPU", marks=needs_openvino)])
def test_ten_thousand_tokens_in_flat_memory(long_folder, draft):
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(long_folder), draft],
                            capture_output=True, text=True, timeout=1800)
    print("\n" + result.stdout)
    assert result.returncode == 0, result.stderr[-4000:]
