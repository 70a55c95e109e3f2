"""Activation statistics for the data-aware scale search (rounding.py): the mean square of each input channel of
every linear layer, from the source model in PyTorch on the shipped calibration text (mirrorsd/data, not the text
``mirrorsd eval`` measures on). Export-time only: torch and transformers are needed here."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CALIBRATION_TOKENS = 512  # tokens of the calibration text fed in one pass


def channel_importance(source: str | Path, tokens: int = CALIBRATION_TOKENS) -> dict[str, np.ndarray]:
    """{weight name ("model.layers.3.mlp.up_proj.weight"): E[x^2] per input channel [K]} of the HF model at
    ``source`` (a folder, or a pinned name mirrorsd-export accepts); a tied LM head is listed under both names."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mirrorsd.data import CALIBRATION_TEXT
    from mirrorsd.export.loading import resolve_model_argument

    folder = resolve_model_argument(source)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tokenizer(CALIBRATION_TEXT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][:, :tokens]
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = x.pow(2).mean(dim=0)
        return record

    handles = [m.register_forward_pre_hook(hook(f"{n}.weight")) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    with torch.inference_mode():
        model(ids)
    for h in handles:
        h.remove()
    result = {name: value.numpy() for name, value in sums.items()}
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in result:
        result["model.embed_tokens.weight"] = result["lm_head.weight"]
    return result
