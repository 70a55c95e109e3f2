"""The models ``mirrorsd eval`` scores, one scorer per kind of folder, picked by what the folder holds:

    mirrorsd.json          an export folder: its target (prefix -> suffix) or draft, on ONNX Runtime (no torch)
    openvino_model.xml     an OpenVINO IR folder from optimum-intel (e.g. NNCF int4), through optimum-intel
    config.json            a Hugging Face folder, through transformers in float32

Each scorer: ``tokenize(text) -> ids`` with its own tokenizer, ``logits(ids [S]) -> [S, vocab]`` from an empty
cache, ``size_bytes`` (the weights on disk: the graph files of the scored model, or the folder's weight files),
``label``, ``kind``; and it is a context manager that frees the model on exit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mirrorsd import names
from mirrorsd.errors import GenerationInputError

ROLES = ("target", "draft")


def open_scorer(folder: Path, role: str = "target", kernels: str = "auto"):
    """``kernels``: the MatMulNBits kernel of an export's ONNX Runtime CPU sessions (auto | mirrorsd | ort); the
    Hugging Face and OpenVINO scorers run no such session and ignore it."""
    folder = Path(folder).expanduser()
    return scorer_kind(folder)(folder, role, kernels)


def scorer_kind(folder: Path):
    """The scorer class for ``folder``, or a clear error (checked for every folder before any model loads)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise GenerationInputError(f"{folder} is not a folder", "eval scores an export, Hugging Face or OpenVINO IR "
                                   "folder", "pass an existing folder")
    for marker, kind in KINDS:
        if (folder / marker).is_file():
            return kind
    raise GenerationInputError(f"{folder} holds no model eval can run",
                               f"it has none of {', '.join(m for m, _ in KINDS)}",
                               "pass an export folder (mirrorsd-export), a Hugging Face folder or an OpenVINO IR "
                               "folder")


def _size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


class _Scorer:
    kind = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass


class ExportScorer(_Scorer):
    """The target (prefix -> suffix, with their KV caches) or the draft of an export folder."""

    kind = "export"

    def __init__(self, folder: Path, role: str, kernels: str = "auto") -> None:
        from mirrorsd.devices.placement import DeviceRequest
        from mirrorsd.runtime import Pipeline

        if role not in ROLES:
            raise GenerationInputError(f"--role {role!r} is not a model of an export", f"choose {' or '.join(ROLES)}",
                                       "pass --role target or --role draft")
        self.role, self.pipe = role, Pipeline.load(folder, DeviceRequest(kernels=kernels))
        self.label = f"{folder} ({role})"
        roles = (names.PREFIX, names.SUFFIX) if role == "target" else (names.DRAFT,)
        files = [self.pipe.manifest.graph(r).file for r in roles]
        self.size_bytes = _size(p for f in files for p in folder.glob(f + "*"))

    def tokenize(self, text: str) -> list[int]:
        return self.pipe.codec.encode(text, chat=False)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        model = self.pipe.target if self.role == "target" else self.pipe.draft
        model.reset()
        return model.extend([int(t) for t in ids])  # [S, vocab]

    def close(self) -> None:
        self.pipe.close()


class HFScorer(_Scorer):
    """A Hugging Face folder through transformers, in float32 (torch needed: the [export] extra)."""

    kind = "hf"

    def __init__(self, folder: Path, role: str, kernels: str = "auto") -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise GenerationInputError(f"Cannot run the Hugging Face folder {folder}", f"{exc}",
                                       "install the export extra: pip install -e '.[export]'") from None
        self.torch, self.label = torch, str(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.size_bytes = _size(list(folder.glob("*.safetensors")) + list(folder.glob("*.bin")))

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def logits(self, ids: np.ndarray) -> np.ndarray:
        with self.torch.inference_mode():
            return self.model(self.torch.from_numpy(ids)[None]).logits[0].float().numpy()

    def close(self) -> None:
        self.model = None


class OpenVINOScorer(_Scorer):
    """An optimum-intel OpenVINO IR folder (the [peers] extra), on the CPU."""

    kind = "openvino"

    def __init__(self, folder: Path, role: str, kernels: str = "auto") -> None:
        try:
            from optimum.intel import OVModelForCausalLM
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise GenerationInputError(f"Cannot run the OpenVINO IR folder {folder}", f"{exc}",
                                       "install the peers extra: pip install -e '.[peers]'") from None
        self.label = str(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = OVModelForCausalLM.from_pretrained(str(folder), device="CPU",
                                                        ov_config={"INFERENCE_PRECISION_HINT": "f32"})
        self.size_bytes = _size(list(folder.glob("openvino_model.*")))

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def logits(self, ids: np.ndarray) -> np.ndarray:
        import torch

        ids_t = torch.from_numpy(ids)[None]
        out = self.model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t))  # no past: a fresh state
        return np.asarray(out.logits[0], np.float32)

    def close(self) -> None:
        self.model = None


KINDS = (("mirrorsd.json", ExportScorer), ("openvino_model.xml", OpenVINOScorer), ("config.json", HFScorer))
