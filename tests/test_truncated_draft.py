"""--draft MODEL --draft-layers K: the draft model's first K layers + its final norm and LM head (a cheaper, less
accurate draft; export/pipeline.py _open_draft). The manifest says K layers, the draft graph holds K layers' KV,
every mode still emits ar's tokens, and K beyond the draft's depth is refused before anything is written."""
from __future__ import annotations

import pytest

from tiny_models import build_model


def test_a_separate_draft_truncated_to_its_first_layers(tmp_path):
    from mirrorsd.errors import ExportOptionError
    from mirrorsd.export.pipeline import ExportOptions, export
    from mirrorsd.manifest import load_manifest
    from mirrorsd.runtime import GenerationConfig, Pipeline

    target = build_model(tmp_path / "target", "qwen2", layers=4)
    draft = build_model(tmp_path / "draft", "qwen2", layers=3, seed=1)
    out = tmp_path / "out"
    export(ExportOptions(model=target, draft=draft, draft_layers=2, output=out))
    manifest = load_manifest(out)
    assert manifest.draft.num_layers == 2 and manifest.target.num_layers == 4
    assert tuple(manifest.graph("draft").kv.layers) == (0, 2)
    with Pipeline.load(out) as pipe:
        for prompt in ([1, 17, 42, 99, 7], [5, 6, 7, 8, 5, 6, 7, 8]):
            ar = pipe.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=16)).tokens
            for mode in ("sd", "mirror"):
                assert pipe.generate(prompt, GenerationConfig(mode=mode, max_new_tokens=16)).tokens == ar, mode
    with pytest.raises(ExportOptionError, match="the draft has 3 layers"):
        export(ExportOptions(model=target, draft=draft, draft_layers=4, output=tmp_path / "too-deep"))
    assert not (tmp_path / "too-deep").exists()
