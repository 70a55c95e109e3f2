"""Tiny exports for the tests of the load-time rewrites that mirrorsd's kernels run (KV in place, prompt rows)."""
from __future__ import annotations

import pytest
from kernel_graphs import library_or_skip
from tiny_models import build_model

from mirrorsd.devices import kernels
from mirrorsd.export.pipeline import ExportOptions, export


def kernels_or_skip():
    """mirrorsd's kernel library, or a skip that says why it cannot run here."""
    library = library_or_skip()
    if kernels.unavailable_reason():
        pytest.skip(f"mirrorsd's kernels cannot run here: {kernels.unavailable_reason()}")
    return library


def tiny_qwen_export(tmp_path_factory, name: str, precision: str, layers: int = 3, kv_heads: int = 2,
                     draft_layers: int = 2):
    """A random qwen2 model (hidden 256, 8 heads) exported at ``precision`` with a ``draft_layers``-layer draft."""
    source = build_model(tmp_path_factory.mktemp(f"{name}-{precision}-src"), "qwen2", layers=layers, hidden=256,
                         heads=8, kv_heads=kv_heads)
    out = tmp_path_factory.mktemp(f"{name}-{precision}") / "q"
    export(ExportOptions(model=source, output=out, draft_layers=draft_layers, target_precision=precision,
                         draft_precision=precision))
    return out
