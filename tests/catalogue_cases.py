"""The reliability catalogue: every recorded case of a new, careless or hostile user meeting a mirrorsd command.

Each case says what it runs (``setup`` builds the workspace and returns a ``Run``) and what a handled case looks
like (``exit``, ``says``, ``quiet``, ``check``); tests/catalogue.py runs it and observes the rest (the user's files,
scratch folders, tracebacks, time). Fixtures: ``hf`` is a tiny 4-layer Llama folder, ``export`` its export (draft =
its first 2 layers), ``export-d4`` the same with an int4 draft, ``hf-vocab400`` a 2-layer model with the same
tokenizer and 400 embedding rows (the others have 384), ``export-vocab400`` an export whose draft is that model
(stitched together the way an older mirrorsd exported it); they are built in tests/catalogue_fixtures.py.
"""
from __future__ import annotations

import os

from catalogue import Case, Run
from catalogue_kernel_cases import KERNEL_CASES
from catalogue_fixtures import (
    NESTED_LOOPS, QUIET_LOOPS, DOUBLING, edit_manifest, edit_config, poison_suffix, external_data_outside,
    unwritable, export_run, quantize_run, generate_run, bench_run, train_run, train_exit_run, python_run, not_suggesting_the_model,
    manifest_says, at_most_one_info_line, outside_copy_absent)


# ---- the catalogue -----------------------------------------------------------------------------------------------
CASES: list[Case] = [*KERNEL_CASES]  # the kernel library's cache: tests/catalogue_kernel_cases.py


def case(id: str, issue: str, what: str, **expect):
    def register(setup):
        CASES.append(Case(id, issue, what, setup, **expect))
        return setup
    return register


# 19.1 output safety ---------------------------------------------------------------------------------------------
@case("export-output-holds-model", "19.1", "export --model D/model --output D --force")
def _(w):
    w.copy("hf", "D/model")
    w.file("D/notes.txt")
    return export_run(w, "--model", "D/model", "--output", "D", "--force", protect=["D"])


@case("export-output-is-model", "19.1", "export --output MODEL --force")
def _(w):
    return export_run(w, "--model", "model", "--output", "model", "--force", protect=["model"])


@case("export-output-empty", "19.1", 'export --output "" --force')
def _(w):
    w.file("keep.txt")
    return export_run(w, "--model", "model", "--output", "", "--force", protect=["."])


@case("export-output-dot", "19.1", "export --output . --force")
def _(w):
    w.file("keep.txt")
    return export_run(w, "--model", "model", "--output", ".", "--force", protect=["."])


@case("export-output-inside-model", "19.1", "export --output MODEL/out")
def _(w):
    return export_run(w, "--model", "model", "--output", "model/out", protect=["model"])


@case("export-output-is-draft", "19.1", "export --draft DRAFT --output DRAFT --force")
def _(w):
    w.copy("hf", "draft")
    return export_run(w, "--model", "model", "--draft", "draft", "--output", "draft", "--force", protect=["draft"])


@case("export-force-user-folder", "19.1", "export --output FOLDER --force, FOLDER not an export")
def _(w):
    w.file("stuff/report.txt")
    return export_run(w, "--model", "model", "--output", "stuff", "--force", protect=["stuff"])


@case("export-force-previous-export", "19.1", "export --output OLD_EXPORT --force (allowed)", exit="ok")
def _(w):
    w.copy("export", "old")
    return export_run(w, "--model", "model", "--output", "old", "--force")


def _quantize_output_case(id: str, what: str, source: str, output: str, user_file: str, protect: str) -> None:
    @case(id, "19.1", what)
    def _(w):
        w.copy("export", source)
        if user_file:
            w.file(user_file)
        return quantize_run(w, source, output, "--force", "--draft-precision", "int4", protect=[protect])


for _quantize_case in (
        ("quantize-output-dot", "quantize --output . --force", "export", ".", "keep.txt", "."),
        ("quantize-output-empty", 'quantize --output "" --force', "export", "", "keep.txt", "."),
        ("quantize-output-is-source", "quantize --output SOURCE --force", "export", "export", "", "export"),
        ("quantize-output-holds-source", "quantize --model D/export --output D --force", "D/export", "D",
         "D/notes.txt", "D"),
        ("quantize-force-user-folder", "quantize --output FOLDER --force, FOLDER not an export", "export", "stuff",
         "stuff/report.txt", "stuff")):
    _quantize_output_case(*_quantize_case)


@case("train-draft-output-holds-draft", "19.1", "train-draft --draft D/draft --output D --force")
def _(w):
    w.file("D/notes.txt")
    return train_run(w, "D", protect=["D"])


@case("train-draft-output-dot", "19.1", "train-draft --output . --force")
def _(w):
    w.file("keep.txt")
    return train_run(w, ".", draft="draft", protect=["."])


@case("train-exit-output-is-model", "19.1", "train-exit --output MODEL --force")
def _(w):
    return train_exit_run(w, "export", "--force")


@case("train-exit-output-dot", "19.1", "train-exit --output . --force")
def _(w):
    w.file("keep.txt")
    return train_exit_run(w, ".", "--force", protect=["keep.txt"])


@case("train-exit-output-user-folder", "19.1", "train-exit --output FOLDER --force, FOLDER not an export")
def _(w):
    w.file("stuff/notes.txt")
    return train_exit_run(w, "stuff", "--force", protect=["stuff"])


@case("train-exit-force-replaces-its-export", "19.1", "train-exit --output OLD_EXPORT --force", exit="ok",
      check=lambda w, outcome: "" if '"exit_adapter"' in (w.root / "old" / "mirrorsd.json").read_text()
      else "old/ was not replaced by the trained export")
def _(w):
    w.copy("export", "old")
    return train_exit_run(w, "old", "--force", "--no-progress")


@case("bench-output-is-model", "19.1", "bench --output MODEL (the export folder)")
def _(w):
    return bench_run(w, output="export")


@case("bench-output-dot", "19.1", "bench --output .")
def _(w):
    w.file("keep.txt")
    return bench_run(w, output=".", protect=["keep.txt"])


@case("bench-output-user-folder", "19.1", "bench --output FOLDER holding the user's report.md")
def _(w):
    w.file("results/report.md")
    return bench_run(w, output="results", protect=["results"])


@case("devices-suggests-model-folder", "19.1", "devices --model HF_FOLDER (the fix it suggests)",
      check=not_suggesting_the_model)
def _(w):
    return Run(["mirrorsd", "devices", "--model", "model"], w.root, protect=[w.copy("hf", "model")])


# 19.6 SIGTERM ---------------------------------------------------------------------------------------------------
@case("export-sigterm", "19.6", "SIGTERM during export", exit="terminated")
def _(w):
    run = export_run(w, "--model", "model", "--output", "out")
    run.terminate_when = "writing suffix"
    return run


@case("quantize-sigterm", "19.6", "SIGTERM during quantize", exit="terminated")
def _(w):
    w.copy("export", "export")
    run = quantize_run(w, "export", "q")
    run.terminate_when = "glob:.q.partial-*"
    return run


@case("train-exit-sigterm", "19.6", "SIGTERM during train-exit", exit="terminated")
def _(w):
    run = train_exit_run(w, "out")
    run.terminate_when = "glob:.out.partial-*"
    return run


# 19.3 hostile folders -------------------------------------------------------------------------------------------
def _template_case(name: str, template: str) -> None:
    @case(f"chat-template-{name}", "19.3", f"chat template: {name.replace('-', ' ')}", says=("chat template",))
    def _(w):
        return generate_run(w, edit=lambda f: edit_manifest(f, lambda m: m["tokenizer"].update(chat_template=template)))


for _name, _template in (("loops", NESTED_LOOPS), ("quiet-loops", QUIET_LOOPS), ("doubling", DOUBLING)):
    _template_case(_name, _template)


@case("quantize-external-data-out", "19.3", "quantize a folder whose external data is a link to outside",
      check=outside_copy_absent)
def _(w):
    external_data_outside(w.copy("export", "export"), w.root / "elsewhere")
    return quantize_run(w, "export", "q", "--target-precision", "int8", protect=["export"])


@case("quantize-linked-folder-out", "19.3", "quantize a folder holding a link to a folder outside",
      check=outside_copy_absent)
def _(w):
    os.symlink(w.file("secret/key", "secret\n").parent, w.copy("export", "export") / "extra")
    return quantize_run(w, "export", "q", protect=["export"])


# 19.4 unbounded values ------------------------------------------------------------------------------------------
@case("config-layers-1e9", "19.4", "config.json num_hidden_layers 1e9", says=("layers",))
def _(w):
    edit_config(w.copy("hf", "model"), num_hidden_layers=10**9)
    return export_run(w, "--model", "model", "--output", "out")


@case("threads-1e6", "19.4", "generate --threads 1000000", says=("--threads",))
def _(w):
    return generate_run(w, "--threads", "1000000")


@case("gamma-1e9", "19.4", "generate --mode sd --gamma 1000000000", says=("gamma",))
def _(w):
    return generate_run(w, "--mode", "sd", "--gamma", "1000000000")


# 19.5 wrong output with exit code 0 ----------------------------------------------------------------------------
@case("config-claims-8-layers", "19.5", "config says 8 layers, the weights hold 4", says=("layer",))
def _(w):
    edit_config(w.copy("hf", "model"), num_hidden_layers=8)
    return export_run(w, "--model", "model", "--output", "out")


@case("draft-vocab-differs-export", "19.5", "export a 400-row draft for a 384-row target", says=("vocabulary",))
def _(w):
    w.copy("hf-vocab400", "draft")
    return export_run(w, "--model", "model", "--draft", "draft", "--output", "out")


@case("draft-vocab-differs-generate", "19.5", "generate with an (older) export whose draft has 400 rows",
      says=("vocabulary",))
def _(w):
    return generate_run(w, "--mode", "sd", "--max-new-tokens", "200", fixture="export-vocab400")


def _nan_case(name: str, *args: str) -> None:
    @case(f"nan-logits-{name}", "19.5", f"NaN target logits, {' '.join(args)}", says=("NaN",))
    def _(w):
        return generate_run(w, *args, edit=poison_suffix)


for _args in (("--mode", "ar"), ("--mode", "sd"), ("--mode", "mirror"), ("--sample",)):
    _nan_case(_args[-1].lstrip("-"), *_args)


# 19.6 / 19.7 late failures, tracebacks -------------------------------------------------------------------------
@case("bench-output-unwritable", "19.6", "bench --output that cannot be written", says=("--output",))
def _(w):
    return bench_run(w, output=str(unwritable(w)))


@case("quantize-output-unwritable", "19.7", "quantize --output that cannot be written")
def _(w):
    w.copy("export", "export")
    return quantize_run(w, "export", str(unwritable(w)))


@case("config-json-list", "19.7", "config.json holding []", says=("config.json",))
def _(w):
    (w.copy("hf", "model") / "config.json").write_text("[]")
    return export_run(w, "--model", "model", "--output", "out")


@case("tokenizer-garbage", "19.7", "garbage tokenizer.json", says=("tokenizer",))
def _(w):
    return generate_run(w, edit=lambda f: (f / "tokenizer" / "tokenizer.json").write_text("{garbage"))


@case("chat-template-syntax", "19.7", "chat template with a syntax error", says=("chat template",))
def _(w):
    broken = "{% for m in messages %}{{ m['content'] }"
    return generate_run(w, edit=lambda f: edit_manifest(f, lambda m: m["tokenizer"].update(chat_template=broken)))


@case("prompt-invalid-utf8", "19.7", "generate --prompt $'\\xff'", says=("UTF-8",))
def _(w):
    run = generate_run(w)
    at = run.argv.index("--prompt") + 1
    run.argv[at] = os.fsdecode(b"\xff")  # the bytes a terminal in another encoding passes
    return run


@case("temperature-1e-40", "19.7", "generate --sample --temperature 1e-40", says=("temperature",))
def _(w):
    return generate_run(w, "--sample", "--temperature", "1e-40")


@case("stdout-closed", "19.7", "generate | head -c 0 (stdout closed)", exit="ok",
      quiet=("Traceback", "BrokenPipe", "Exception ignored"))
def _(w):
    return generate_run(w, stdout="closed")


@case("stdout-closed-json", "18.5", "generate --json | head (stdout closed)", exit="ok",
      quiet=("Traceback", "BrokenPipe", "Exception ignored"))
def _(w):
    return generate_run(w, "--json", stdout="closed")


@case("stdout-full-disk", "19.7", "generate > /dev/full", says=("stdout",))
def _(w):
    return generate_run(w, stdout="devfull")


@case("api-config-none", "19.7", "Pipeline.generate(prompt, config=None)", exit="ok")
def _(w):
    return python_run(w, "from mirrorsd.runtime import Pipeline\nwith Pipeline.load('export') as p:\n"
                         "    print(len(p.generate([1, 2, 3], None).tokens))")


@case("bench-questions-garbage", "19.7", "bench --questions with a garbage file", says=("question",))
def _(w):
    run = bench_run(w)
    (w.root / "q.jsonl").write_text("not json\n")
    return run


@case("runner-up-k-above-vocab", "19.7", "generate --runner-up-k 100000", says=("runner",))
def _(w):
    return generate_run(w, "--runner-up-k", "100000")


@case("bench-modes-empty", "19.7", "bench --modes ,", says=("--modes",))
def _(w):
    return bench_run(w, "--modes", ",")


@case("devices-device-without-model", "19.7", "devices --draft-device X without --model", says=("--model",))
def _(w):
    return Run(["mirrorsd", "devices", "--draft-device", "X"], w.root)


# 18.5 rough edges -----------------------------------------------------------------------------------------------
@case("quantize-keeps-untouched-side", "18.5", "quantize an int4-draft export with --target-precision int4",
      exit="ok", check=manifest_says(target_precision="int4", draft_precision="int4"))
def _(w):
    w.copy("export-d4", "d4")
    return quantize_run(w, "d4", "q", "--target-precision", "int4")


@case("bench-without-chat-template", "18.5", "bench on a model without a chat template", exit="ok", says=("raw",))
def _(w):
    return bench_run(w, edit=lambda f: edit_manifest(f, lambda m: m["tokenizer"].update(chat_template=None)))


@case("cpu-only-quiet", "18.5", "generate on a machine without accelerators (stderr)", exit="ok",
      quiet=("fell back", "Warning", "note:"), check=at_most_one_info_line)
def _(w):
    return generate_run(w)


@case("cpu-only-api-no-warning", "18.5", "Pipeline.load and generate with warnings as errors", exit="ok")
def _(w):
    return python_run(w, "import warnings\nwarnings.simplefilter('error')\nfrom mirrorsd.runtime import Pipeline\n"
                         "with Pipeline.load('export') as p:\n    print(len(p.generate([1, 2, 3]).tokens))")


import catalogue_cases_round3  # noqa: E402,F401 - registers the cases of round three (caches, trainers, files)
