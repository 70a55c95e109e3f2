"""Workspaces for the reliability catalogue (tests/catalogue_cases.py): the fixtures it builds once, the commands its
cases run, and the checks they share."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from catalogue import Run, Workspace

MODEL_ARGS = ["--draft-layers", "2"]
GEN = ["--max-new-tokens", "8"]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
QUIET_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='xy') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


# ---- fixtures ----------------------------------------------------------------------------------------------------
def build_fixtures(root: Path) -> dict[str, Path]:
    """The shared read-only fixtures (built once; cases copy them)."""
    from tiny_models import build_model

    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.export.requantize import requantize

    root.mkdir(parents=True, exist_ok=True)
    hf = build_model(root / "hf", "llama", layers=4)
    export(ExportOptions(model=hf, output=root / "export", draft_layers=2))
    requantize(root / "export", root / "export-d4", "fp32", "int4")
    wide = build_model(root / "hf-vocab400", "llama", layers=2, vocab_size=400)
    export(ExportOptions(model=wide, output=root / "wide", draft_layers=2))
    stitch_draft(root / "export", root / "wide", root / "export-vocab400")
    return {"hf": hf, "export": root / "export", "export-d4": root / "export-d4", "hf-vocab400": wide,
            "export-vocab400": root / "export-vocab400", "questions": write_questions(root / "questions.jsonl")}


def stitch_draft(target_export: Path, draft_export: Path, out: Path) -> None:
    """``target_export`` with the draft of ``draft_export``: what an export without the vocabulary-shape check made."""
    shutil.copytree(target_export, out)
    shutil.copy(draft_export / "draft.onnx", out / "draft.onnx")
    theirs = json.loads((draft_export / "mirrorsd.json").read_text())
    edit_manifest(out, lambda m: m.update(draft=theirs["draft"], graphs={**m["graphs"], "draft": theirs["graphs"]["draft"]}))


def write_questions(path: Path) -> Path:
    rows = [{"question_id": i, "category": "coding", "turns": [text]} for i, text in enumerate(["Write a loop."])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def edit_manifest(folder: Path, edit) -> None:
    path = folder / "mirrorsd.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_config(folder: Path, **values) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def poison_suffix(folder: Path) -> None:
    """NaN in the final norm's weight: every logit of the target becomes NaN (the graph itself runs)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    path = folder / "suffix.onnx"
    model = onnx.load(str(path))
    norms = [t for t in model.graph.initializer if "norm" in t.name and len(t.dims) == 1]
    last = norms[-1]
    last.CopyFrom(numpy_helper.from_array(np.full(tuple(last.dims), np.nan, np.float32), last.name))
    onnx.save(model, str(path))


def external_data_outside(folder: Path, outside: Path) -> None:
    """Move draft.onnx's weights into draft.onnx.data, then make that file a link to a copy outside the folder."""
    import onnx

    model = onnx.load(str(folder / "draft.onnx"))
    onnx.save_model(model, str(folder / "draft.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="draft.onnx.data", size_threshold=0)
    outside.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder / "draft.onnx.data"), str(outside / "draft.onnx.data"))
    os.symlink(outside / "draft.onnx.data", folder / "draft.onnx.data")


def unwritable(w: Workspace) -> Path:
    """A folder path that cannot be created: under a read-only folder, or (as root, whom modes do not stop) a file."""
    locked = w.root / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        (locked / "probe").mkdir()
    except OSError:
        return locked / "out"
    (locked / "probe").rmdir()
    os.chmod(locked, 0o755)
    blocker = w.file("locked/blocker", "a file where a folder would go\n")
    return blocker / "out"


# ---- runs --------------------------------------------------------------------------------------------------------
def export_run(w: Workspace, *args: str, protect=(), limit_s: float = 60.0) -> Run:
    if "model" in args and not (w.root / "model").exists():
        w.copy("hf", "model")
    extra = [] if "--draft" in args else MODEL_ARGS  # without --draft: the target's first 2 layers
    return Run(["mirrorsd-export", *args, *extra], w.root, protect=[w.root / p for p in protect], limit_s=limit_s)


def quantize_run(w: Workspace, source: str, output: str, *extra: str, protect=()) -> Run:
    args = extra or ("--draft-precision", "int4")
    return Run(["mirrorsd", "quantize", "--model", source, "--output", output, *args], w.root,
               protect=[w.root / p for p in protect])


def generate_run(w: Workspace, *args: str, fixture: str = "export", edit=None, stdout: str = "pipe") -> Run:
    folder = w.copy(fixture, "export")
    if edit is not None:
        edit(folder)
    return Run(["mirrorsd", "generate", "--model", "export", "--prompt", "Hello", *GEN, *args], w.root,
               stdout=stdout, protect=[folder])


def bench_run(w: Workspace, *args: str, output: str = "out", edit=None, protect=()) -> Run:
    folder = w.copy("export", "export")
    if edit is not None:
        edit(folder)
    shutil.copy(w.fixtures["questions"], w.root / "q.jsonl")
    return Run(["mirrorsd", "bench", "--model", "export", "--questions", "q.jsonl", "--per-category", "1",
                "--max-new-tokens", "4", "--modes", "ar", "--output", output, *args], w.root,
               protect=[folder, *(w.root / p for p in protect)], limit_s=90)


def train_run(w: Workspace, output: str, draft: str = "D/draft", protect=()) -> Run:
    w.copy("hf", draft)
    w.copy("export", "export")
    shutil.copy(w.fixtures["questions"], w.root / "q.jsonl")
    return Run(["mirrorsd-train-draft", "--draft", draft, "--target", "export", "--output", output, "--force",
                "--prompts", "q.jsonl", "--max-steps", "1", "--no-progress"], w.root,
               protect=[w.root / p for p in protect])


def train_exit_run(w: Workspace, output: str, *extra: str, protect=()) -> Run:
    """mirrorsd-train-exit on the export fixture, small enough to finish in seconds (12 questions, rank 4)."""
    from tiny_models import write_questions as trainer_questions

    w.copy("export", "export")
    trainer_questions(w.root, 12)
    return Run(["mirrorsd-train-exit", "--model", "export", "--output", output, "--prompts", "question.jsonl",
                "--train-prompts", "6", "--eval-prompts", "3", "--holdout", "1", "--max-new-tokens", "6",
                "--rank", "4", "--epochs", "1", "--threads", "1", *extra], w.root,
               protect=[w.root / "export", *(w.root / p for p in protect)], limit_s=90)


def python_run(w: Workspace, code: str) -> Run:
    w.copy("export", "export")
    return Run(["python", "-c", code], w.root)


def not_suggesting_the_model(w: Workspace, outcome) -> str:
    return "suggests --output model" if "--output model" in outcome.stderr.replace(str(w.root) + "/", "") else ""


def manifest_says(**expected):
    def check(w: Workspace, outcome) -> str:
        manifest = w.root / "q" / "mirrorsd.json"
        if not manifest.is_file():
            return "no q/mirrorsd.json written"
        options = json.loads(manifest.read_text())["export_options"]
        wrong = {k: options.get(k) for k, v in expected.items() if options.get(k) != v}
        return f"export_options {wrong}, wanted {expected}" if wrong else ""
    return check


def at_most_one_info_line(w: Workspace, outcome) -> str:
    lines = [line for line in outcome.stderr.splitlines() if line.strip() and not line.startswith("[")]
    return f"{len(lines)} lines besides the result: {lines[:3]}" if len(lines) > 1 else ""


def outside_copy_absent(w: Workspace, outcome) -> str:
    q = w.root / "q"
    return f"{q} holds a copy of a file from outside the source" if (q / "draft.onnx.data").exists() or \
        (q / "extra").exists() else ""
