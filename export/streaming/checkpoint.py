"""The resumable training state: OUTPUT/train_state/ = trainable tensors + optimizer moments + state.json.

Written into a scratch folder and swapped in, so an interrupted save leaves the previous state intact. Only the
trainable tensors are stored (adapters and stream embeddings for lora); the frozen rest comes from --draft again.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mirrorsd.errors import ExportOptionError

STATE_DIR = "train_state"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"


def save_state(folder: Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, record: dict) -> None:
    from safetensors.torch import save_file

    final, scratch = Path(folder) / STATE_DIR, Path(folder) / f".{STATE_DIR}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    save_file({name: p.detach().contiguous() for name, p in params.items()}, str(scratch / TRAINABLE_FILE))
    moments = {f"{index}.{key}": value.detach().contiguous()
               for index, slots in optimizer.state_dict()["state"].items() for key, value in slots.items()}
    save_file(moments, str(scratch / OPTIMIZER_FILE))
    (scratch / STATE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    old = Path(folder) / f".{STATE_DIR}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(scratch, final)
    shutil.rmtree(old, ignore_errors=True)


def read_record(folder: Path) -> dict | None:
    """The saved run's record (step, options, evaluation), or None when there is none; OutputFolderError when
    it is damaged (not a regular file, too large, not a JSON object with its keys)."""
    from mirrorsd.errors import OutputFolderError
    from mirrorsd.user_files import JSON_LIMIT, read_json

    path = Path(folder) / STATE_DIR / STATE_FILE
    if not os.path.lexists(path):
        return None
    fix = "start over with --force (the cached target answers are kept), or restore the folder"
    record = read_json(path, JSON_LIMIT, lambda why: OutputFolderError(f"The saved training state {path} is "
                                                                       "damaged", why, fix))
    if not isinstance(record, dict) or not {"step", "train_seconds", "options"} <= set(record) or \
            not isinstance(record["options"], dict):
        raise OutputFolderError(f"The saved training state {path} is damaged", "it lacks step, train_seconds or "
                                "options", fix)
    return record


def load_state(folder: Path, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    """Copy the saved trainable tensors into ``params`` (same names and shapes) and restore the optimizer."""
    from safetensors.torch import load_file

    state_dir = Path(folder) / STATE_DIR
    saved = load_file(str(state_dir / TRAINABLE_FILE))
    if set(saved) != set(params) or any(saved[n].shape != params[n].shape for n in params):
        raise ExportOptionError(f"The training state in {state_dir} does not fit this model",
                                "its trainable tensors differ in names or shapes",
                                "resume with the options of the first run, or start afresh with --force")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])
    moments = load_file(str(state_dir / OPTIMIZER_FILE))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in moments.items():
        index, slot = key.split(".", 1)
        state.setdefault(int(index), {})[slot] = value
    full = optimizer.state_dict()
    full["state"] = state
    optimizer.load_state_dict(full)
