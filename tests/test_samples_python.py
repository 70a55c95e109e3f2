"""The Python samples run as a user would run them (a subprocess) on a tiny export folder."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mirrorsd.runtime import GenerationConfig

SAMPLES = Path(__file__).resolve().parent.parent / "samples" / "python"
PROMPT = [1, 17, 42, 99, 7]


def run_sample(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SAMPLES / script), *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_ar_tokens_and_stats(exported, pipelines):
    folder = exported("llama")
    expected = pipelines(folder).generate(PROMPT, GenerationConfig(mode="ar", max_new_tokens=12)).tokens
    done = run_sample("generate.py", str(folder), "--ids", *map(str, PROMPT), "--mode", "sd",
                      "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    assert f"tokens: {expected}" in done.stdout  # sd emits exactly the target's greedy tokens
    assert "mode sd: 12 tokens" in done.stdout and "tok/s" in done.stdout


def test_chat_answers_and_quits(exported):
    done = run_sample("chat.py", str(exported("llama")), "--max-new-tokens", "6", "--stats",
                      stdin="hello\nand again\n/quit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("bot> ") == 2
    assert done.stderr.count("mean accepted") == 2
