"""Limits that bound what hostile input can make the machine do: the chat-template sandbox (time and size), the
memory a generation request needs, thread counts, and the output-folder rules (a link that leads to the source).

The CLI-level cases (one line, no traceback, nothing deleted) are in the catalogue (test_reliability_catalogue.py);
these check the limits themselves, quickly and in process.
"""
from __future__ import annotations

import os
import time

import pytest

from mirrorsd.devices.placement import DeviceRequest
from mirrorsd.errors import ChatTemplateError, GenerationInputError, OutputFolderError
from mirrorsd.manifest import load_manifest
from mirrorsd.output_folder import EXPORT, check_output
from mirrorsd.runtime import GenerationConfig, limits
from mirrorsd.runtime.chat_template import MAX_SECONDS, render

BOMBS = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "quiet loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "~ doubling": "{% set ns = namespace(s='xy') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling": "{% set ns = namespace(s='xy') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "repetition": "{{ 'x' * 1000000000 }}",
    "list repetition": "{{ ([1] * 1000000000)|length }}",
    "method width": "{{ 'x'.center(1000000000) }}",
    "filter width": "{{ 'x'|center(1000000000) }}",
    "format width": "{{ '%0999999999d' % 1 }}",
    "str.format width": "{{ '{:999999999}'.format(1) }}",
    "power tower": "{{ (((10 ** 64) ** 64) ** 64) ** 64 }}",
    "join": "{% set l = ['x' * 900000] * 100 %}{{ l|join('') }}",
    "replace": "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "syntax error": "{% for m in messages %}{{ m['content'] }",
    "undefined call": "{{ nothing() }}",
}


@pytest.mark.parametrize("template", list(BOMBS.values()), ids=list(BOMBS))
def test_hostile_chat_template_fails_fast_and_small(template):
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError) as info:
        render(template, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert time.perf_counter() - started < MAX_SECONDS + 2.0
    assert info.value.what and info.value.why and info.value.fix


def test_real_chat_templates_still_render():
    from tiny_models import CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 300_000}]
    text = render(CHAT_TEMPLATE, messages=messages, add_generation_prompt=True)
    assert text.endswith("<|bos|>assistant\n") and "x" * 300_000 in text
    assert render("{{ '%5d|%s' % (3, 'a') }}{{ '{}-{}'.format(1, 2) }}{{ 2 ** 10 }}") == "    3|a1-21024"


@pytest.fixture(scope="module")
def manifest(exported):
    return load_manifest(exported("llama", draft_layers=2))


def test_a_request_beyond_this_machines_memory_is_refused(manifest, monkeypatch):
    config = GenerationConfig(mode="mirror", gamma=64, branches=8, branch_batch=8, max_new_tokens=400)
    need = limits.request_bytes(config, manifest, 10, 512)
    limits.check_generation(config, manifest, 10, 512)  # this machine holds it
    monkeypatch.setattr(limits, "machine_memory", lambda: need - 1)
    with pytest.raises(GenerationInputError, match="GiB for its KV caches"):
        limits.check_generation(config, manifest, 10, 512)
    smaller = GenerationConfig(mode="mirror", gamma=4, branches=8, branch_batch=2, max_new_tokens=400)
    assert limits.request_bytes(smaller, manifest, 10, 512) < need
    limits.check_generation(smaller, manifest, 10, 512)


@pytest.mark.parametrize("threads", [0, -1, limits.cores() + 1, 1_000_000, 2.5])
def test_thread_counts_beyond_the_cores_are_refused(threads):
    with pytest.raises(GenerationInputError, match="cores"):
        limits.check_threads(DeviceRequest(target_threads=threads, draft_threads=threads))


def test_an_output_that_links_to_the_source_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mirrorsd.json").write_text("{}")  # even a folder that looks like an export
    os.symlink(tmp_path / "model", tmp_path / "link")
    for output in ("link", "link/..", str(tmp_path / "model" / "sub")):
        with pytest.raises(OutputFolderError, match="overlaps a source|working directory"):
            check_output(output, [tmp_path / "model"], True, EXPORT)
    assert check_output("exports/new", [tmp_path / "model"], False, EXPORT) == tmp_path / "exports" / "new"
