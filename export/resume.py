"""What a resumable export has finished, kept in its scratch folder (``.NAME.partial/resume.json``).

    {"fingerprint": {...options, sources, mirrorsd version...},
     "built": ["prefix", "exit_head"],                        graph files complete in the scratch folder
     "validated": {"target": {"prefix": {"split_hidden": 3e-6}, ...}},   checks (and quantization effects) per model
     "counts": {"prefix": {"gguf_carried.Q4_K": 98, "embedding.Q4_K": 1}, ...},  what writing each graph counted
    }

A run with --resume continues only a state with the same fingerprint: the same options and the same source files
(name, size, modification time); anything else is refused with a message that says how to start over. The file is
replaced atomically after each graph, and removed before the folder is published.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mirrorsd.errors import ExportOptionError

STATE_FILE = "resume.json"
BUILDING = ".building-"  # prefix of the scratch entries a graph is written under until it is complete


@dataclass
class ResumeState:
    folder: Path
    fingerprint: dict
    built: list[str] = field(default_factory=list)
    validated: dict[str, dict] = field(default_factory=dict)
    counts: dict[str, dict] = field(default_factory=dict)  # role -> what writing it counted (GGUF blocks, embedding)

    def is_built(self, role: str, file: str) -> bool:
        return role in self.built and (self.folder / file).is_file()

    def mark_built(self, role: str, counts: dict | None = None) -> None:
        if role not in self.built:
            self.built.append(role)
        if counts is not None:
            self.counts[role] = counts
        self.save()

    def unbuild(self, roles) -> None:
        self.built = [r for r in self.built if r not in roles]
        self.save()

    def record(self, model: str, results: dict) -> None:
        self.validated[model] = results
        self.save()

    def save(self) -> None:
        path = self.folder / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "built": self.built,
                                   "validated": self.validated, "counts": self.counts}, indent=1))
        os.replace(tmp, path)

    def remove(self) -> None:
        (self.folder / STATE_FILE).unlink(missing_ok=True)


def open_state(folder: Path, fingerprint: dict) -> ResumeState:
    """The state of ``folder`` (a resumable scratch folder), started fresh when there is none yet."""
    for leftover in folder.glob(f"{BUILDING}*"):  # a graph that was being written when the last run stopped
        shutil.rmtree(leftover)
    path = folder / STATE_FILE
    if not path.is_file():
        if any(folder.iterdir()):
            raise ExportOptionError(f"'{folder}' holds files but no {STATE_FILE}",
                                    "it is not a resumable export this version of mirrorsd started",
                                    f"delete '{folder}' and export again")
        state = ResumeState(folder, fingerprint)
        state.save()
        return state
    saved = _read_state(path, folder)
    if saved.get("fingerprint") != fingerprint:
        changed = sorted(k for k in set(fingerprint) | set(saved.get("fingerprint", {}))
                         if fingerprint.get(k) != saved.get("fingerprint", {}).get(k))
        raise ExportOptionError(f"The partial export in '{folder}' was made differently",
                                f"these differ from this run: {', '.join(changed)}",
                                f"rerun with the same options and models, or delete '{folder}' to start over")
    return ResumeState(folder, fingerprint, list(saved.get("built", [])), dict(saved.get("validated", {})),
                       dict(saved.get("counts", {})))


def _read_state(path: Path, folder: Path) -> dict:
    """The saved state of a partial export; ExportOptionError when it is damaged (garbage, not a regular file, too
    large, not an object with a fingerprint)."""
    from mirrorsd.user_files import JSON_LIMIT, read_json

    fix = f"delete '{folder}' and export again"
    saved = read_json(path, JSON_LIMIT, lambda why: ExportOptionError(f"The partial export's {path.name} in "
                                                                      f"'{folder}' is damaged", why, fix))
    if not isinstance(saved, dict) or not isinstance(saved.get("fingerprint"), dict) or \
            not isinstance(saved.get("built", []), list) or not isinstance(saved.get("validated", {}), dict) or \
            not isinstance(saved.get("counts", {}), dict):
        raise ExportOptionError(f"The partial export's {path.name} in '{folder}' is damaged",
                                "it is not the object mirrorsd-export writes", fix)
    return saved


def source_stamp(path: Path) -> list:
    """Name, size and modification time of a model file, or of every file of a model folder."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
