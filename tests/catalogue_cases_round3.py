"""The reliability catalogue, round three: caches that are never trusted blindly, user-named files read with a cap,
trainers that check every flag before they work, and values no run can mean (registered into catalogue_cases.CASES).

Every case that touches profiles points ``$MIRRORSD_PROFILES`` at a folder of its workspace, so no case reads or
writes the user's own cache.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from catalogue import Run
from catalogue_cases import case
from catalogue_fixtures import (GEN, at_most_one_info_line, bench_run, edit_manifest, export_run, generate_run,
                                python_run, train_exit_run, train_run, unwritable)

DOCS_PROFILES = Path(__file__).resolve().parent.parent / "docs" / "profiles"


# ---- helpers -----------------------------------------------------------------------------------------------------
def no_chat_template(folder: Path) -> None:
    """An export (or HF folder) of a base model: no chat template in the manifest or the tokenizer's files."""
    if (folder / "mirrorsd.json").is_file():
        edit_manifest(folder, lambda m: m["tokenizer"].update(chat_template=None))
        folder = folder / "tokenizer"
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))


def no_template_broken_target(folder: Path) -> None:
    """No chat template, and target graphs that cannot load: a flag refused only after the target loads (or after
    the template is applied) shows up as another error here."""
    no_chat_template(folder)
    for name in ("prefix.onnx", "suffix.onnx"):
        (folder / name).write_bytes(b"not a graph")


def profiled(w, *args: str, bad=None, fixture: str = "export") -> Run:
    """``mirrorsd generate`` (default mode: auto) with a profile cache of the workspace's own; ``bad(cache)``
    damages it first (after one run has measured and cached the good profile)."""
    run = generate_run(w, *args, fixture=fixture)
    cache = w.root / "profiles"
    run.env["MIRRORSD_PROFILES"] = str(cache)
    if bad is not None:
        subprocess.run(run.command(), cwd=run.cwd, env={**os.environ, **run.env}, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, timeout=600)
        bad(cache)
    return run


def the_cached(cache: Path) -> Path:
    files = sorted(cache.glob("export-*.json"))
    assert len(files) == 1, files
    return files[0]


def replace_with(make):
    """Replace the one cached profile by what ``make(path)`` puts at its path (the entry the run needs)."""
    def bad(cache: Path) -> None:
        path = the_cached(cache)
        path.unlink()
        make(path)
    return bad


def beside(name: str, make):
    """Put ``make(path)`` beside the good cached profile, as export-NAME.json (every such file is looked at)."""
    return lambda cache: make(cache / f"export-{name}.json")


def garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def folder(path: Path) -> None:
    path.mkdir()


def wrong_type(path: Path) -> None:
    path.write_text(json.dumps({"schema": "mirrorsd-profile/1", "kind": "measured", "machine": "x", "splits": 5}))


def endless(path: Path) -> None:
    path.symlink_to("/dev/zero")


def fifo(path: Path) -> None:
    os.mkfifo(path)


def too_large(path: Path) -> None:
    with open(path, "wb") as handle:  # sparse: a gigabyte that takes no disk
        handle.truncate(2**30)


def nested(path: Path, depth: int = 100_000) -> None:
    path.write_text("[" * depth + "]" * depth)


def loop(path: Path) -> None:
    path.symlink_to(path.name)


def says_nothing_of(*phrases: str):
    def check(w, outcome) -> str:
        found = [p for p in phrases if p in outcome.stderr]
        return f"says {found}" if found else ""
    return check


def both(*checks):
    def check(w, outcome) -> str:
        return "; ".join(problem for c in checks if (problem := c(w, outcome)))
    return check


def absent(*relative: str):
    def check(w, outcome) -> str:
        left = [r for r in relative if os.path.lexists(w.root / r)]
        return f"left {left}" if left else ""
    return check


def plan_run(w, *args: str, profile=None) -> Run:
    """``mirrorsd plan --profile FILE``: FILE is the RTX 4060 example unless ``profile(path)`` makes another."""
    path = w.root / "profile.json"
    if profile is None:
        shutil.copy(DOCS_PROFILES / "rtx4060-laptop-npu.json", path)
    else:
        profile(path)
    return Run(["mirrorsd", "plan", "--profile", str(path), *args], w.root)


def exit_inputs(w, hits: dict) -> tuple[Path, Path]:
    """A sweep of ``hits`` and a profile with prefix times measured at layer 2 (tests/test_exit_choice.py's)."""
    data = json.loads((DOCS_PROFILES / "rtx4060-laptop-npu.json").read_text())
    split = data["splits"][0]
    data["splits"] = [{**split, "prefix_s": [v / 2 for v in split["verify_s"]], "detail": {"exit_layer": 2}}]
    profile = w.file("profile.json", json.dumps(data))
    sweep = w.file("sweep.json", json.dumps({"layers": 4, "results": [
        {"layer": layer, "trained": {"4": h}, "untrained": {"4": h}} for layer, h in hits.items()]}))
    return sweep, profile


# 23.4 a read-only profile cache ------------------------------------------------------------------------------------
@case("profiles-unwritable-generate", "23.4", "generate (auto) with a profile cache that cannot be written",
      exit="ok", says=("could not be saved",), check=at_most_one_info_line)
def _(w):
    run = generate_run(w)
    run.env["MIRRORSD_PROFILES"] = str(unwritable(w))
    return run


@case("profiles-unwritable-devices", "23.4", "devices --profile with a profile cache that cannot be written",
      exit="ok", says=("could not be saved", "Mode auto loads"))
def _(w):
    w.copy("export", "export")
    return Run(["mirrorsd", "devices", "--profile", "--model", "export"], w.root,
               env={"MIRRORSD_PROFILES": str(unwritable(w))}, limit_s=120)


@case("devices-profile-threads-1e6", "23.1", "devices --profile --threads 1000000", says=("--threads",))
def _(w):
    w.copy("export", "export")
    return Run(["mirrorsd", "devices", "--profile", "--model", "export", "--threads", "1000000"], w.root,
               env={"MIRRORSD_PROFILES": str(w.root / "profiles")})


# 23.5 bad entries in the profile cache -----------------------------------------------------------------------------
for _name, _make in (("garbage", garbage), ("folder", folder), ("wrong-type", wrong_type), ("endless", endless),
                     ("fifo", fifo), ("too-large", too_large), ("nested", nested), ("loop", loop)):
    case(f"profiles-beside-{_name}", "23.5", f"generate (auto), the cache holds a good profile and a {_name} one",
         exit="ok", says=("ignoring the cached profile",), check=at_most_one_info_line)(
        lambda w, make=_make, name=_name: profiled(w, bad=beside(name, make)))

for _name, _make in (("garbage", garbage), ("folder", folder), ("endless", endless), ("fifo", fifo)):
    case(f"profiles-needed-{_name}", "23.5", f"generate (auto), the profile it needs is a {_name}",
         exit="ok", says=("ignoring the cached profile",))(
        lambda w, make=_make: profiled(w, bad=replace_with(make)))


# 23.8 user-named files read whole ----------------------------------------------------------------------------------
@case("plan-profile-dev-zero", "23.8", "plan --profile /dev/zero", says=("profile",))
def _(w):
    return Run(["mirrorsd", "plan", "--profile", "/dev/zero"], w.root, limit_s=20)


@case("plan-profile-fifo", "23.8", "plan --profile FIFO (nobody writes)", says=("profile",))
def _(w):
    run = plan_run(w, profile=fifo)
    run.limit_s = 20
    return run


@case("plan-exit-hits-dev-zero", "23.8", "plan --exit-hits /dev/zero", says=("sweep",))
def _(w):
    return plan_run(w, "--exit-hits", "/dev/zero")


@case("export-exit-hits-dev-zero", "23.8", "export --exit-hits /dev/zero --exit-profile P", says=("sweep",))
def _(w):
    _, profile = exit_inputs(w, {2: 0.5})
    return export_run(w, "--model", "model", "--output", "out", "--exit-hits", "/dev/zero", "--exit-profile",
                      str(profile))


@case("export-exit-profile-dev-zero", "23.8", "export --exit-hits S --exit-profile /dev/zero", says=("profile",))
def _(w):
    sweep, _ = exit_inputs(w, {2: 0.5})
    return export_run(w, "--model", "model", "--output", "out", "--exit-hits", str(sweep), "--exit-profile",
                      "/dev/zero")


@case("bench-questions-dev-zero", "23.8", "bench --questions /dev/zero", says=("question",))
def _(w):
    run = bench_run(w)
    run.argv[run.argv.index("q.jsonl")] = "/dev/zero"
    return run


@case("train-exit-prompts-dev-zero", "23.8", "train-exit --prompts /dev/zero", says=("--prompts",))
def _(w):
    run = train_exit_run(w, "out")
    run.argv[run.argv.index("question.jsonl")] = "/dev/zero"
    return run


@case("manifest-dev-zero", "23.8", "generate, the export's mirrorsd.json a link to /dev/zero",
      says=("mirrorsd.json",))
def _(w):
    def link(folder):
        (folder / "mirrorsd.json").unlink()
        (folder / "mirrorsd.json").symlink_to("/dev/zero")
    return generate_run(w, edit=link)


# 23.9 tracebacks ---------------------------------------------------------------------------------------------------
@case("plan-profile-binary", "23.9", "plan --profile BINARY_FILE", says=("profile",))
def _(w):
    return plan_run(w, profile=garbage)


@case("plan-profile-folder", "23.9", "plan --profile FOLDER", says=("profile",))
def _(w):
    return plan_run(w, profile=folder)


@case("plan-profile-wrong-type", "23.9", "plan --profile with splits: 5", says=("profile",))
def _(w):
    return plan_run(w, profile=wrong_type)


@case("plan-profile-wrong-acceptance", "23.9", "plan --profile with acceptance alpha: \"high\"", says=("profile",))
def _(w):
    def make(path):
        data = json.loads((DOCS_PROFILES / "rtx4060-laptop-npu.json").read_text())
        data["acceptance"]["alpha"] = "high"
        path.write_text(json.dumps(data))
    return plan_run(w, profile=make)


@case("manifest-nested", "23.9", "generate, mirrorsd.json nested 100000 deep", says=("mirrorsd.json",))
def _(w):
    return generate_run(w, edit=lambda f: nested(f / "mirrorsd.json"))


@case("model-symlink-loop-generate", "23.9", "generate --model LOOP (a symbolic link to itself)", says=("loop",))
def _(w):
    loop(w.root / "loop")
    return Run(["mirrorsd", "generate", "--model", "loop", "--prompt", "Hello", *GEN], w.root)


@case("model-symlink-loop-export", "23.9", "export --model LOOP", says=("loop",))
def _(w):
    loop(w.root / "loop")
    return Run(["mirrorsd-export", "--model", "loop", "--output", "out", "--draft-layers", "2"], w.root)


@case("output-symlink-loop-export", "23.9", "export --output LOOP", says=("loop",))
def _(w):
    loop(w.root / "loop")
    return export_run(w, "--model", "model", "--output", "loop")


@case("output-symlink-loop-quantize", "23.9", "quantize --output LOOP", says=("loop",))
def _(w):
    w.copy("export", "export")
    loop(w.root / "loop")
    return Run(["mirrorsd", "quantize", "--model", "export", "--output", "loop", "--draft-precision", "int4"], w.root)


@case("output-symlink-loop-bench", "23.9", "bench --output LOOP", says=("loop",))
def _(w):
    loop(w.root / "loop")
    return bench_run(w, output="loop")


@case("api-load-devices-string", "23.9", "Pipeline.load(folder, devices=\"cpu\")", exit="ok")
def _(w):
    return python_run(w, "from mirrorsd.runtime import Pipeline\nwith Pipeline.load('export', devices='cpu') as p:\n"
                         "    print(len(p.generate([1, 2, 3]).tokens))")


@case("api-generate-batch-config-none", "23.9", "Pipeline.generate_batch(ids, None)", exit="ok")
def _(w):
    return python_run(w, "from mirrorsd.runtime import Pipeline\nwith Pipeline.load('export') as p:\n"
                         "    print([len(r) for r in p.generate_batch([[1, 2, 3], [4, 5]], None)])")


# 23.10 impossible values -------------------------------------------------------------------------------------------
@case("plan-alpha-2", "23.10", "plan --alpha 2", says=("--alpha",))
def _(w):
    return plan_run(w, "--alpha", "2")


@case("plan-reuse-negative", "23.10", "plan --reuse -1", says=("--reuse",))
def _(w):
    return plan_run(w, "--reuse", "-1")


@case("plan-alpha-nan", "23.10", "plan --alpha nan", says=("--alpha",))
def _(w):
    return plan_run(w, "--alpha", "nan")


@case("plan-exit-hits-nan", "23.10", "plan --exit-hits with a NaN hit rate", says=("hit rate",))
def _(w):
    sweep, profile = exit_inputs(w, {1: 0.2, 2: float("nan"), 3: 0.9})
    return Run(["mirrorsd", "plan", "--profile", str(profile), "--exit-hits", str(sweep)], w.root)


@case("export-exit-hits-nan", "23.10", "export --exit-hits with a NaN hit rate", says=("hit rate",))
def _(w):
    sweep, profile = exit_inputs(w, {1: 0.2, 2: float("nan"), 3: 0.9})
    return export_run(w, "--model", "model", "--output", "out", "--exit-hits", str(sweep), "--exit-profile",
                      str(profile))


@case("export-exit-hits-above-one", "23.10", "export --exit-hits with a hit rate of 1.5", says=("hit rate",))
def _(w):
    sweep, profile = exit_inputs(w, {1: 0.2, 2: 1.5, 3: 0.9})
    return export_run(w, "--model", "model", "--output", "out", "--exit-hits", str(sweep), "--exit-profile",
                      str(profile))


@case("manifest-exit-layer-negative", "23.10", "generate, the manifest's exit_layer -3", says=("exit_layer",))
def _(w):
    return generate_run(w, edit=lambda f: edit_manifest(f, lambda m: m.update(exit_layer=-3)))


@case("manifest-top-k-0", "23.10", "generate, the manifest's top_k 0", says=("top_k",))
def _(w):
    return generate_run(w, edit=lambda f: edit_manifest(f, lambda m: m.update(top_k=0)))


@case("bench-per-category-0", "23.10", "bench --per-category 0", says=("--per-category",))
def _(w):
    run = bench_run(w)
    run.argv[run.argv.index("--per-category") + 1] = "0"
    return run


@case("api-generate-bytes", "23.10", "Pipeline.generate(b\"hello\")", says=("bytes",))
def _(w):
    return python_run(w, "import sys\nfrom mirrorsd.errors import MirrorSDError\nfrom mirrorsd.runtime import Pipeline\n"
                         "with Pipeline.load('export') as p:\n    try:\n        p.generate(b'hello')\n"
                         "    except MirrorSDError as exc:\n        print(f'error: {exc}', file=sys.stderr)\n"
                         "        sys.exit(2)\n")


# 23.12 late checks, misleading words, noise ------------------------------------------------------------------------
def broken_draft(folder: Path) -> None:
    (folder / "draft.onnx").write_bytes(b"not a graph")


@case("bench-gamma-0-first", "23.12", "bench --gamma 0 (the draft graph also broken: gamma is checked first)",
      says=("gamma",))
def _(w):
    return bench_run(w, "--gamma", "0", "--modes", "sd", edit=broken_draft)


@case("export-output-name-too-long", "23.12", "export --output NAME_OF_300_CHARACTERS",
      says=("name",), check=says_nothing_of("disk space"))
def _(w):
    return export_run(w, "--model", "model", "--output", "x" * 300)


@case("shared-pool-quiet", "23.12", "generate --shared-pool (ONNX Runtime's warnings on stderr)", exit="ok",
      quiet=("onnxruntime", "W:"))
def _(w):
    return profiled(w, "--shared-pool", "--mode", "ar")


# 23.1 / 23.2 / 23.10 every trainer flag, checked before any expensive step ----------------------------------------
TRAIN_EXIT_FLAGS = (("threads", "1000000"), ("rank", "0"), ("rank", "-1"), ("rank", "100000"), ("lr", "nan"),
                    ("lr", "0"), ("epochs", "0"), ("batch", "0"), ("max-new-tokens", "0"), ("eval-prompts", "0"),
                    ("generation-batch", "0"), ("max-minutes", "-1"), ("max-minutes", "nan"), ("prompt-rows", "-1"),
                    ("holdout", "0"), ("train-prompts", "-1"), ("max-prompt-tokens", "0"), ("seed", "-1"))
TRAIN_DRAFT_FLAGS = (("threads", "1000000"), ("streams", "0"), ("stream-layers", "0"), ("stream-layers", "99"),
                     ("lora-rank", "0"), ("lora-alpha", "nan"), ("epochs", "nan"), ("max-steps", "0"),
                     ("max-minutes", "0"), ("lr", "inf"), ("warmup-steps", "-1"), ("anchors", "0"),
                     ("grad-accum", "0"), ("save-every", "-1"), ("generation-batch", "0"), ("max-new-tokens", "1"),
                     ("seed", "-1"), ("eval-prompts", "0"), ("train-prompts", "-1"))


def _train_exit_flag_case(name: str, value: str) -> None:
    @case(f"train-exit-{name}-{value}", "23.1", f"train-exit --{name} {value} (no chat template, target unloadable)",
          says=(f"--{name}",), check=absent("out"))
    def _(w):
        run = train_exit_run(w, "out", f"--{name}", value)
        no_template_broken_target(w.root / "export")
        run.protect = []
        return run


def _train_draft_flag_case(name: str, value: str) -> None:
    @case(f"train-draft-{name}-{value}", "23.1", f"train-draft --{name} {value} (no chat template, target unloadable)",
          says=(f"--{name}",), check=absent("out"))
    def _(w):
        run = train_run(w, "out", draft="draft")
        run.argv += [f"--{name}", value]
        no_template_broken_target(w.root / "export")
        return run


for _flag in TRAIN_EXIT_FLAGS:
    _train_exit_flag_case(*_flag)
for _flag in TRAIN_DRAFT_FLAGS:
    _train_draft_flag_case(*_flag)


@case("train-draft-missing-draft", "23.2", "train-draft --draft MISSING (target without chat template)",
      says=("missing",), check=absent("out"))
def _(w):
    run = train_run(w, "out", draft="draft")
    run.argv[run.argv.index("--draft") + 1] = "missing"
    no_template_broken_target(w.root / "export")
    return run


@case("train-draft-other-vocabulary", "23.2", "train-draft, a target of 400 tokens and a draft of 384",
      says=("vocabulary",), check=absent("out"))
def _(w):
    run = train_run(w, "out", draft="draft")
    w.copy("hf-vocab400", "wide")
    no_chat_template(w.root / "wide")
    run.argv[run.argv.index("--target") + 1] = "wide"
    return run


def trained(marker: str, folder: str = "out"):
    return lambda w, outcome: "" if (w.root / folder / marker).is_file() else f"no {folder}/{marker} written"


@case("train-exit-without-chat-template", "23.2", "train-exit on an export without a chat template", exit="ok",
      says=("raw completion",), check=trained("exit_head.onnx"))
def _(w):
    run = train_exit_run(w, "out")
    no_chat_template(w.root / "export")
    run.protect = []
    return run


@case("train-draft-without-chat-template", "23.2", "train-draft on a target without a chat template", exit="ok",
      says=("raw completion",), check=trained("streaming.json"))
def _(w):
    from tiny_models import write_questions as trainer_questions

    run = train_run(w, "out", draft="draft")
    no_chat_template(w.root / "export")
    trainer_questions(w.root, 12)
    run.argv.remove("--force")
    run.argv[run.argv.index("q.jsonl")] = "question.jsonl"
    run.argv += ["--train-prompts", "4", "--eval-prompts", "2", "--holdout", "1", "--max-new-tokens", "8",
                 "--stream-layers", "1", "--threads", "1"]
    return run


# 23.11 train-draft stages its folder -------------------------------------------------------------------------------
@case("train-draft-sigterm", "23.11", "SIGTERM during train-draft (while the target answers)", exit="terminated",
      check=absent("out"))
def _(w):
    run = train_run(w, "out", draft="draft")
    run.terminate_when = "loading target"
    return run


@case("train-draft-force-fails-keeps-old", "23.11", "train-draft --force over its old folder, the run fails",
      check=lambda w, outcome: "" if (w.root / "out" / "streaming.json").is_file() else "the old out/ was lost")
def _(w):
    run = train_run(w, "out", draft="draft")
    old = w.root / "out"
    old.mkdir()
    (old / "streaming.json").write_text("{}\n")
    (w.root / "q.jsonl").write_text("not json\n")  # the run fails after the folder was accepted
    return run


# 23.5 the trainers' caches ----------------------------------------------------------------------------------------
def small_train_draft(w, output: str = "out") -> Run:
    """train-draft on the export fixture that finishes in seconds (12 questions, 1 step, 1 stream layer)."""
    from tiny_models import write_questions as trainer_questions

    run = train_run(w, output, draft="draft")
    trainer_questions(w.root, 12)
    run.argv[run.argv.index("q.jsonl")] = "question.jsonl"
    run.argv += ["--train-prompts", "4", "--eval-prompts", "2", "--holdout", "1", "--max-new-tokens", "8",
                 "--stream-layers", "1", "--threads", "1"]
    return run


@case("train-draft-answer-cache-garbage", "23.5", "train-draft --force, its cached target answers are garbage",
      exit="ok", check=trained("streaming.json"))
def _(w):
    run = small_train_draft(w)
    old = w.root / "out"
    old.mkdir()
    (old / "distill.json").write_bytes(bytes(range(256)))
    (old / "distill-train.jsonl").write_text('{"question_id": 1, "prompt": "x"}\n')
    (old / "distill-eval.jsonl").write_text("[[[\n")
    return run


@case("train-draft-resume-damaged-state", "23.5", "train-draft --resume, its saved state.json is garbage",
      says=("damaged",), check=lambda w, o: "" if (w.root / "out" / "train_state" / "state.json").is_file()
      else "the saved state was removed")
def _(w):
    run = small_train_draft(w)
    run.argv[run.argv.index("--force")] = "--resume"
    (w.root / "out" / "train_state").mkdir(parents=True)
    (w.root / "out" / "train_state" / "state.json").write_bytes(bytes(range(256)))
    return run


@case("train-exit-answer-cache-garbage", "23.5", "train-exit --force over its export, the cached answers garbage",
      exit="ok", check=trained("exit_sparse.onnx", "old"))
def _(w):
    run = train_exit_run(w, "old", "--force", "--no-progress")
    w.copy("export", "old")
    (w.root / "old" / "exit_training").mkdir()
    for name in ("distill-train-6.jsonl", "distill-eval-6.jsonl"):
        (w.root / "old" / "exit_training" / name).write_bytes(bytes(range(256)))
    return run


@case("export-resume-state-garbage", "23.5", "export --resume, the partial export's resume.json is garbage",
      says=("damaged",), check=lambda w, o: "" if (w.root / ".out.partial" / "resume.json").is_file()
      else "the partial export was removed")
def _(w):
    run = export_run(w, "--model", "model", "--output", "out", "--resume")
    (w.root / ".out.partial").mkdir()
    (w.root / ".out.partial" / "resume.json").write_bytes(bytes(range(256)))
    return run


# 23.7's class on the Python side: callbacks -----------------------------------------------------------------------
API_ERROR = ("import sys\nfrom mirrorsd.errors import MirrorSDError\nfrom mirrorsd.runtime import GenerationConfig, "
             "Pipeline\nwith Pipeline.load('export') as p:\n    try:\n{body}\n    except MirrorSDError as exc:\n"
             "        print(f'error: {{exc}}', file=sys.stderr)\n        sys.exit(2)\n")


def _reentry_case(id: str, what: str, inner: str) -> None:
    @case(id, "23.7", what, says=("on_text",))
    def _(w):
        body = (f"        def cb(text):\n            {inner}\n"
                "        p.generate([1, 2, 3], GenerationConfig(mode='mirror', max_new_tokens=8), on_text=cb)")
        run = python_run(w, API_ERROR.format(body=body))
        run.limit_s = 30
        return run


_reentry_case("api-reenter-generate", "Pipeline.generate from inside its own on_text (mirror)",
              "p.generate([1, 2, 3], GenerationConfig(mode='ar', max_new_tokens=2))")
_reentry_case("api-reenter-close", "Pipeline.close from inside its own on_text (mirror)", "p.close()")


@case("api-callback-raises", "23.7", "on_text raises (mirror): the error reaches the caller, the pipeline still works",
      exit="ok", says=("raised", "again"))
def _(w):
    run = python_run(w, "from mirrorsd.runtime import GenerationConfig, Pipeline\nwith Pipeline.load('export') as p:\n"
                        "    def cb(text):\n        raise ValueError('mine')\n    try:\n"
                        "        p.generate([1, 2, 3], GenerationConfig(mode='mirror', max_new_tokens=8), on_text=cb)\n"
                        "    except ValueError:\n        print('raised')\n"
                        "    print('again', len(p.generate([1, 2, 3], GenerationConfig(mode='mirror', "
                        "max_new_tokens=8)).tokens))\n")
    run.limit_s = 30
    return run
