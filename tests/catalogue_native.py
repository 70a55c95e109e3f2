"""The reliability catalogue's C cases: hostile calls through libmirrorsd's C ABI (runtime/native/tests/hostile.c,
built with the library by tests/native_tools.py), one case per process. A handled case exits with the status the
library returned and one "error: what. Why: ... Fix: ..." line (or exits 0 where the call must succeed); a crash
(a signal), a hang (killed at twice the limit) or a wrong answer (exit 100) fails it.

Kept apart from catalogue_cases.py (the command-line cases); tests/test_reliability_catalogue.py runs both.
"""
from __future__ import annotations

from catalogue import Case, Run

EXEC = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"  # the driver replaces the interpreter: signals show
OK, ARGUMENT, BUSY = 0, 1, 8  # mirrorsd_status

# driver case -> (issue item, what, status, words its error line holds)
HOSTILE = {
    "open-folder": ("23.12", "mirrorsd_open('/'): the fix it suggests", 2, "--output NEW_FOLDER"),
    "open-null-folder": ("23.7", "mirrorsd_open(NULL folder)", ARGUMENT, "folder is NULL"),
    "open-null-model": ("23.7", "mirrorsd_open(..., NULL model out)", ARGUMENT, "model is NULL"),
    "info-null-model": ("23.7", "mirrorsd_model_get_info(NULL, &info)", ARGUMENT, "model is NULL"),
    "info-null-info": ("23.7", "mirrorsd_model_get_info(model, NULL)", ARGUMENT, "info is NULL"),
    "generate-null-model": ("23.7", "mirrorsd_generate(NULL model)", ARGUMENT, "model is NULL"),
    "generate-null-prompt": ("23.7", "mirrorsd_generate(NULL prompt, length 3)", ARGUMENT, "prompt is NULL"),
    "generate-null-config": ("23.7", "mirrorsd_generate(NULL config)", ARGUMENT, "config is NULL"),
    "generate-null-callback": ("23.7", "mirrorsd_generate(NULL on_token)", ARGUMENT, "on_token is NULL"),
    "close-null": ("23.7", "mirrorsd_close(NULL), the _init functions on NULL", OK, "ok"),
    "target-threads-1e6": ("23.6", "open with target_threads 1000000", ARGUMENT, "target_threads 1000000 is out of range"),
    "draft-threads-negative": ("23.6", "open with draft_threads -3", ARGUMENT, "draft_threads -3 is out of range"),
    "max-new-tokens-0": ("23.6", "generate max_new_tokens 0", ARGUMENT, "max_new_tokens must be a positive integer"),
    "max-new-tokens-negative": ("23.6", "generate max_new_tokens -5", ARGUMENT, "max_new_tokens must be"),
    "gamma-0": ("23.6", "sd with gamma 0", ARGUMENT, "gamma must be a positive integer"),
    "gamma-int-max": ("23.6", "sd with gamma 2147483647", ARGUMENT, "is not below the context"),
    "branches-0": ("23.6", "mirror with branches 0", ARGUMENT, "branches must be a positive integer"),
    "branch-batch-negative": ("23.6", "mirror with branch_batch -1", ARGUMENT, "branch_batch must be"),
    "runner-up-k-int-max": ("23.6", "mirror with runner_up_k 2147483647", ARGUMENT, "larger than the vocabulary"),
    "mode-99": ("23.6", "generate mode 99", ARGUMENT, "Unknown mode 99"),
    "branch-budget-negative": ("23.6", "mirror with branch_budget -1", ARGUMENT, "Unknown branch_budget -1"),
    "exit-head-2": ("23.6", "mirror with exit_head 2", ARGUMENT, "exit_head must be 0 or 1"),
    "fallback-7": ("23.6", "sd with on_draft_failure 7", ARGUMENT, "Unknown on_draft_failure 7"),
    "timeout-nan": ("23.6", "mirror with draft_timeout_s NaN", ARGUMENT, "draft_timeout_s must be a positive"),
    "timeout-0": ("23.6", "mirror with draft_timeout_s 0", ARGUMENT, "draft_timeout_s must be a positive"),
    "timeout-negative": ("23.6", "mirror with draft_timeout_s -1", ARGUMENT, "draft_timeout_s must be a positive"),
    "timeout-1e300": ("23.6", "mirror with draft_timeout_s 1e300 (no limit)", OK, "ok"),
    "timeout-infinity": ("23.6", "mirror with draft_timeout_s infinity (no limit)", OK, "ok"),
    "prompt-length-negative": ("23.7", "generate prompt_length -1", ARGUMENT, "prompt_length is negative"),
    "prompt-id-out-of-range": ("23.7", "generate with prompt id INT64_MAX", ARGUMENT, "is out of range"),
    "config-struct-size-0": ("23.7", "generate config with struct_size 0", ARGUMENT, "struct_size is 0"),
    "reenter-generate-mirror": ("23.7", "mirrorsd_generate on the same model inside on_token (mirror)", BUSY,
                                "from inside the same model's on_token"),
    "reenter-generate-ar": ("23.7", "mirrorsd_generate on the same model inside on_token (ar)", BUSY,
                            "from inside the same model's on_token"),
    "reenter-close-mirror": ("23.7", "mirrorsd_close on the same model inside on_token", BUSY,
                             "mirrorsd_close was called from inside"),
    "callback-generates-other-model": ("23.7", "mirrorsd_generate on another model inside on_token (allowed)", OK,
                                       "ok"),
    "generate-after-close": ("23.7", "mirrorsd_generate after mirrorsd_close", ARGUMENT, "is not open"),
    "info-after-close": ("23.7", "mirrorsd_model_get_info after mirrorsd_close", ARGUMENT, "is not open"),
    "double-close": ("23.7", "mirrorsd_close twice", ARGUMENT, "is not open"),
    "made-up-handle": ("23.7", "mirrorsd_generate on a pointer that never was a model", ARGUMENT, "is not open"),
    "close-during-generate": ("23.7", "mirrorsd_close while another thread generates", BUSY, "another thread"),
}


def _driver_build(w):
    import native_tools

    if why := native_tools.compiler_missing():
        import pytest

        pytest.skip(why)
    return native_tools.build(w.fixtures["export"].parent / "native-build")


def _run(name: str, folder: str = "", copy: str = ""):
    def setup(w) -> Run:
        tools = _driver_build(w)
        if copy:
            w.copy(copy, folder)
        return Run(["python", "-c", EXEC, str(tools.hostile), folder or str(w.fixtures["export"]), name], w.root,
                   limit_s=30)
    return setup


def _status(expected: int):
    def check(w, outcome) -> str:
        return "" if outcome.code == expected else f"status {outcome.code}, expected {expected}"
    return check


CASES: list[Case] = [
    Case(f"c-{name}", issue, what, _run(name), exit="ok" if status == OK else "error", says=(words,),
         check=_status(status))
    for name, (issue, what, status, words) in HOSTILE.items() if name != "open-folder"]
CASES += [
    Case("c-open-root-fix", "23.12", "mirrorsd_open('/'): the fix it suggests", _run("open-folder", "/"),
         says=("--output NEW_FOLDER",), quiet=("--output /",), check=_status(2)),
    Case("c-open-model-folder-fix", "23.12", "mirrorsd_open(a Hugging Face folder): the fix it suggests",
         _run("open-folder", "model", copy="hf"), says=("--output exports/model",), check=_status(2)),
]
