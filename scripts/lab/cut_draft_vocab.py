"""An existing export's copy whose draft head scores only N ids (what ``mirrorsd-export --draft-vocab N`` writes),
without exporting again: the target graphs and the tokenizer are hard links to the source folder's files, the draft
graph is cut with export/vocab_subset.py (checked against the full draft graph) and the manifest records the subset.

    python scripts/lab/cut_draft_vocab.py SOURCE_EXPORT NEW_FOLDER N
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from mirrorsd import names
from mirrorsd.export import vocab_subset
from mirrorsd.manifest import VocabSubsetInfo, load_manifest


def main(source: Path, target: Path, n: int) -> None:
    manifest = load_manifest(source)
    if manifest.draft_vocab_subset is not None:
        sys.exit(f"{source} already has a draft vocabulary subset ({manifest.draft_vocab_subset.size} ids)")
    target.mkdir(parents=True)
    draft_file = names.graph_file(names.DRAFT)
    for item in source.iterdir():
        if item.is_dir():
            shutil.copytree(item, target / item.name)
        elif item.name == draft_file or item.name == draft_file + ".data":
            shutil.copyfile(item, target / item.name)  # cut below: a copy, never the source's file
        elif item.name != names.MANIFEST_FILE:
            os.link(item, target / item.name)
    vocab = manifest.draft.vocab_size
    tokenizer_json = json.loads((target / manifest.tokenizer.directory / "tokenizer.json").read_text(encoding="utf-8"))
    ids = vocab_subset.subset_from_json(tokenizer_json, vocab, n)
    spec = manifest.graphs[names.DRAFT]
    diff = vocab_subset.restrict_file(target / draft_file, ids, vocab, spec.kv)
    graphs = dict(manifest.graphs)
    graphs[names.DRAFT] = dataclasses.replace(spec, validation={**spec.validation, vocab_subset.CHECK: diff})
    options = {**manifest.export_options, "draft_vocab": n}
    dataclasses.replace(manifest, graphs=graphs, export_options=options,
                        draft_vocab_subset=VocabSubsetInfo(n, vocab_subset.ORDER)).save(target)
    print(f"{target}: draft head cut to {n} of {vocab} ids (max |diff| over the subset {diff:.3g})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
