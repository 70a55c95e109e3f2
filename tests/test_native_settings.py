"""One definition of the generation settings across Python and C: runtime/config.py names them, sets their defaults
and bounds; libmirrorsd takes them from runtime/native/src/settings.hpp, generated from it. These tests fail when a
C name, a C default or a C bound differs from Python's, and they list what the C library lacks (instead of a
hand-kept parity map)."""
from __future__ import annotations

import ctypes
import dataclasses
import re

from mirrorsd.errors import GenerationInputError
from mirrorsd.runtime import GenerationConfig
from mirrorsd.runtime import config as py
from mirrorsd.runtime.native import settings as generated
from mirrorsd.runtime.native import source_dir

# Python's settings and modes that libmirrorsd does not have, and why. A feature added on one side only fails
# test_names_are_pythons until it is implemented in C or listed here.
C_LACKS = {
    "chat": "text prompts: the C ABI takes token ids (no tokenizer)",
    "system": "text prompts: the C ABI takes token ids (no tokenizer)",
    "record_margins": "a research statistic of the Python decoder",
    "do_sample": "sampling: greedy only (the keyed randomness is NumPy's PCG64 streams)",
    "temperature": "sampling: greedy only",
    "top_k": "sampling: greedy only",
    "top_p": "sampling: greedy only",
    "repetition_penalty": "sampling: greedy only",
    "seed": "sampling: greedy only",
    "verify": "sampling: the exact/residual rules matter at T > 0 only",
    "streaming": "the streaming draft (draft_streaming.onnx) is not driven; the plain draft gives the same tokens",
    "ngram": "prompt lookup (runtime/ngram.py) is Python-only",
    "draft_confidence": "the draft-confidence stop (runtime/rollout.py) is Python-only: C's sd drafts gamma tokens",
    "ngram_min": "prompt lookup is Python-only",
    "ngram_max": "prompt lookup is Python-only",
}
C_LACKS_MODES = {"auto": "no planner (latency model, profiles) in C", "ngram": "prompt lookup is Python-only"}


def struct_fields(text: str, start: str, end: str) -> list[str]:
    """Field names of the C/C++ struct between ``start`` and ``end`` (lines 'type name;' or 'type name = x;')."""
    body = text[text.index(start):]
    body = body[:body.index(end)]
    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S)
    return re.findall(r"^\s+[\w:<>]+\s+(\w+)\s*(?:=[^;]*)?;", body, flags=re.M)


def c_abi_fields() -> list[str]:
    header = (source_dir() / "include" / "mirrorsd.h").read_text()
    return [f for f in struct_fields(header, "typedef struct mirrorsd_generate_config {", "} mirrorsd_generate_config;")
            if f != "struct_size"]


def cpp_fields() -> list[str]:
    src = source_dir() / "src"
    mirror = struct_fields((src / "mirror_worker.hpp").read_text(), "struct MirrorSettings {", "bool operator==")
    engine = struct_fields((src / "engine.hpp").read_text(), "struct GenerationConfig {", "};")
    return mirror + [f for f in engine if f != "mirror"]


def test_the_header_is_generated_from_config():
    assert (source_dir() / "src" / "settings.hpp").read_text() == generated.header(), \
        "runtime/native/src/settings.hpp is stale: run python -m mirrorsd.runtime.native.settings"


def test_names_are_pythons_and_what_c_lacks_is_listed():
    python = [f.name for f in dataclasses.fields(GenerationConfig)]
    for side, names in (("mirrorsd.h", c_abi_fields()), ("C++", cpp_fields())):
        assert set(names) <= set(python), f"{side} names that Python lacks: {sorted(set(names) - set(python))}"
    assert sorted(c_abi_fields()) == sorted(cpp_fields())
    assert sorted(set(python) - set(c_abi_fields())) == sorted(C_LACKS)
    assert sorted(set(py.MODE_CHOICES) - set(generated.C_MODES)) == sorted(C_LACKS_MODES)


def c_defaults(lib) -> dict:
    from mirrorsd.runtime.native import BUDGETS, DRAFT_FAILURES, GenerateConfig, MODES

    config = GenerateConfig()
    lib.mirrorsd_generate_config_init(ctypes.byref(config))
    out = {name: getattr(config, name) for name in c_abi_fields()}
    for name, choices in (("mode", MODES), ("branch_budget", BUDGETS), ("on_draft_failure", DRAFT_FAILURES)):
        out[name] = {v: k for k, v in choices.items()}[out[name]]
    out["exit_head"] = bool(out["exit_head"])
    return out


def test_c_defaults_are_pythons(native_build, exported):
    from mirrorsd.devices.backends import default_threads
    from mirrorsd.runtime.native import NativeModel, load_library

    python = GenerationConfig()
    expected = {name: getattr(python, name) for name in c_abi_fields()}
    expected["mode"] = generated.C_MODE_WITHOUT_AUTO if python.mode not in generated.C_MODES else python.mode
    assert c_defaults(load_library(native_build.library)) == expected
    with NativeModel(exported("llama", draft_layers=2), native_build.library, kernels="ort") as model:
        assert model.threads == {"target": default_threads(), "draft": default_threads()}  # every core, as Python


def python_refuses(pipe, prompt, **settings) -> bool:
    try:
        pipe.generate(prompt, GenerationConfig(**{"max_new_tokens": 2, **settings}))
    except GenerationInputError:
        return True
    return False


def c_refuses(model, prompt, **settings) -> bool:
    try:
        model.generate(prompt, **{"max_new_tokens": 2, **settings})
    except GenerationInputError as error:
        assert error.status == 1 and "Why:" in str(error)
        return True
    return False


def test_c_bounds_are_pythons(native_models, pipelines, exported):
    """Each bound, just outside and just inside, in both runtimes: refused or decoded alike."""
    folder = exported("llama", draft_layers=2)
    pipe, model, prompt = pipelines(folder), native_models(folder), [1, 17, 42]
    context, vocab = model.info["context_limit"], model.info["vocab_size"]
    cases = [dict(mode="mirror", **{name: value}) for name in py.COUNTS
             for value in (py.COUNT_MIN - 1, py.COUNT_MIN, -(2**31))]
    cases += [dict(mode="mirror", draft_timeout_s=v) for v in (0.0, -1.0, float("nan"), 5.0,
                                                               py.DRAFT_TIMEOUT_NEVER_S, float("inf"))]
    cases += [dict(mode=m, gamma=g) for m in ("sd", "mirror") for g in (context - 1, context)]
    cases += [dict(mode="ar", gamma=context)]  # ar has no window: gamma is not bounded by the context there
    cases += [dict(mode="mirror", runner_up_k=k) for k in (vocab, vocab + 1)]
    cases += [dict(mode="sd", runner_up_k=vocab + 1)]  # only mirror keeps runner-ups
    differ = [case for case in cases if python_refuses(pipe, prompt, **case) != c_refuses(model, prompt, **case)]
    assert not differ
    refused = [case for case in cases if c_refuses(model, prompt, **case)]
    assert len(refused) == 2 * len(py.COUNTS) + 3 + 2 + 1  # the checks can fail: these are out of range


def test_c_thread_bounds_are_pythons(native_build, exported):
    from mirrorsd.devices.placement import DeviceRequest
    from mirrorsd.runtime.limits import check_threads, cores
    from mirrorsd.runtime.native import NativeModel

    folder = exported("llama", draft_layers=2)
    for threads in (-1, cores() + 1, 10**6, 1, cores()):
        try:
            check_threads(DeviceRequest(target_threads=threads))
            python = False
        except GenerationInputError:
            python = True
        try:
            NativeModel(folder, native_build.library, target_threads=threads, kernels="ort").close()
            c = False
        except GenerationInputError:
            c = True
        assert python == c == (threads < 1 or threads > cores()), threads
