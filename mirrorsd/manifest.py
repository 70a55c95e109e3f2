"""The export folder's manifest: frozen dataclasses <-> JSON, strict, versioned.

Loading rejects unknown keys, missing keys, other schema versions and file names that leave the folder. The
runtime reads every tensor and file name from here.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mirrorsd.errors import ManifestError
from mirrorsd.names import MANIFEST_FILE

SCHEMA_VERSION = 1
ATTENTION_KINDS = ("grouped", "eager")  # Manifest.attention


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. ``shape`` holds ints for fixed axes and names for dynamic ones."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class KVSpec:
    """KV-cache I/O of one graph: name templates take the *global* layer index."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    layers: tuple[int, int]  # [first, end) global layer indices
    num_kv_heads: int
    head_dim: int
    dtype: str

    def layer_indices(self) -> range:
        return range(self.layers[0], self.layers[1])


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph of the folder. ``model`` says which network it belongs to ("target" or "draft")."""

    role: str
    file: str
    model: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    layer_range: tuple[int, int]
    kv: KVSpec | None = None
    validation: dict[str, float] = field(default_factory=dict)
    static_shapes: dict[str, int] = field(default_factory=dict)

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    source: str


@dataclass(frozen=True)
class TokenizerInfo:
    directory: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None


@dataclass(frozen=True)
class ExitAdapterInfo:
    """The trained exit adapter inside exit_head.onnx (mirrorsd-train-exit): x -> x + (x @ down) @ up before the LM
    head. Scores are held-out shares of answer positions whose target token is in the exit's top-k ("top1", "top4",
    "top8") and the mean cross-entropy ("loss"), untrained (the plain exit head) and trained."""

    rank: int
    train_rows: int
    heldout_rows: int
    untrained: dict[str, float]
    trained: dict[str, float]
    epochs: int
    seconds: float


@dataclass(frozen=True)
class VocabSubsetInfo:
    """The draft's vocabulary subset (mirrorsd-export --draft-vocab N): its LM head scores only ``size`` ids, the
    first of the ranking ``order`` (export/vocab_subset.py); every other id gets a very negative finite logit."""

    size: int
    order: str


@dataclass(frozen=True)
class Manifest:
    """Everything a runtime needs to drive an export folder."""

    schema_version: int
    target: ModelInfo
    draft: ModelInfo
    exit_layer: int
    top_k: int
    graphs: dict[str, GraphSpec]
    tokenizer: TokenizerInfo
    generation_defaults: dict[str, Any]
    export_options: dict[str, Any]
    versions: dict[str, str]
    # How the graphs compute attention: "grouped" (export/graphs/attention.py: a row's result does not depend on the
    # rows verified beside it, so a quantized target may use int8 activations) or "eager" (folders exported before
    # it; quantized targets then keep fp32 activations).
    attention: str = "eager"
    exit_adapter: ExitAdapterInfo | None = None  # a trained exit adapter (mirrorsd-train-exit), else None
    draft_vocab_subset: VocabSubsetInfo | None = None  # mirrorsd-export --draft-vocab N, else None (whole vocabulary)

    def graph(self, role: str) -> GraphSpec:
        try:
            return self.graphs[role]
        except KeyError:
            raise ManifestError(
                f"The manifest has no '{role}' graph", f"it lists {sorted(self.graphs)}",
                "re-export the folder with this version of mirrorsd-export") from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False)

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_FILE
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path


def load_manifest(folder: str | os.PathLike) -> Manifest:
    """Read and check ``mirrorsd.json`` of an export folder; every file it names must stay inside the folder."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not folder.is_dir():
        raise ManifestError(f"'{folder}' is not a folder", "an export folder holds mirrorsd.json and ONNX graphs",
                            "pass the --output folder of mirrorsd-export")
    if not path.is_file():
        if (folder / "config.json").is_file():  # a model folder: export it into a new folder, never into itself
            raise ManifestError(f"'{folder}' has no {MANIFEST_FILE}", "it is a Hugging Face model folder, not an export",
                                f"export it first: mirrorsd-export --model {folder} --output exports/{folder.name}, "
                                f"then pass --model exports/{folder.name}")
        raise ManifestError(f"'{folder}' has no {MANIFEST_FILE}", "it is not a mirrorsd export folder",
                            "pass an export folder (mirrorsd-export --model MODEL --output NEW_FOLDER writes one)")
    data = read_json_object(path)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ManifestError(
            f"{path} has schema version {version!r}", f"this mirrorsd reads version {SCHEMA_VERSION} only",
            "re-export the model with this version of mirrorsd-export (or install the mirrorsd that wrote it)")
    manifest = _from_json(Manifest, data, "manifest")
    _check_ranges(manifest, path)
    if manifest.attention not in ATTENTION_KINDS:
        raise ManifestError(f"{path} names an unknown attention kind {manifest.attention!r}",
                            f"this mirrorsd knows {', '.join(ATTENTION_KINDS)}",
                            "re-export the model with this version of mirrorsd-export")
    for spec in manifest.graphs.values():
        check_inside(folder, spec.file, f"graph '{spec.role}'")
    check_inside(folder, manifest.tokenizer.directory, "tokenizer directory")
    return manifest


def _check_ranges(manifest: Manifest, path: Path) -> None:
    """Numbers no export writes: sizes below 1, an exit layer outside the target, no candidates per position."""
    def bad(field: str, value, rule: str) -> ManifestError:
        return ManifestError(f"{path}: {field} is {value!r}", f"it must be {rule}",
                             "re-export the model (the file was edited or damaged)")

    for side in ("target", "draft"):
        info = getattr(manifest, side)
        for name in ("num_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(info, name) < 1:
                raise bad(f"{side}.{name}", getattr(info, name), "at least 1")
    if not 1 <= manifest.exit_layer < manifest.target.num_layers:
        raise bad("exit_layer", manifest.exit_layer, f"a layer 1..{manifest.target.num_layers - 1} of the target")
    if not 1 <= manifest.top_k <= manifest.draft.vocab_size:
        raise bad("top_k", manifest.top_k, f"1..{manifest.draft.vocab_size} (candidates per position)")


def read_json_object(path: Path) -> dict:
    """A JSON object from a file of an export folder (a regular file below a size cap, valid and not nested too
    deeply); ManifestError if it is not one."""
    from mirrorsd.user_files import JSON_LIMIT, read_json

    data = read_json(path, JSON_LIMIT, lambda why: ManifestError(f"Cannot read {path}", why, "re-export the folder"))
    if not isinstance(data, dict):
        raise ManifestError(f"{path} does not hold a JSON object", "the file is damaged", "re-export the folder")
    return data


def check_inside(folder: Path, relative: str, what: str) -> Path:
    """Refuse a file name that is absolute or climbs out of ``folder`` (a folder someone sent you may try)."""
    pure = PurePosixPath(relative.replace("\\", "/"))
    if pure.is_absolute() or relative.startswith(("/", "\\")) or (len(relative) > 1 and relative[1] == ":") \
            or ".." in pure.parts:
        raise ManifestError(f"The manifest's {what} points outside the export folder: {relative!r}",
                            "file names must be relative and stay inside the folder",
                            "do not use this folder; re-export the model yourself")
    resolved = (folder / pure).resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise ManifestError(f"The manifest's {what} resolves outside the export folder: {resolved}",
                            "a symbolic link leads out of the folder", "re-export the model into a fresh folder")
    return resolved


def _from_json(tp: Any, value: Any, where: str) -> Any:
    """Build ``tp`` from parsed JSON, rejecting unknown or missing keys and wrong kinds."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _bad(where, f"an object for {tp.__name__}", value)
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = set(value) - set(fields)
        if unknown:
            raise ManifestError(f"Unknown key(s) {sorted(unknown)} in {where}",
                                "the manifest was written by another version of mirrorsd", "re-export the folder")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _from_json(hints[name], value[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ManifestError(f"Missing key '{name}' in {where}", "the manifest is incomplete",
                                    "re-export the folder")
        return tp(**kwargs)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_json(arg, value, where)
            except ManifestError as exc:
                errors.append(exc)
        raise errors[0] if errors else _bad(where, str(tp), value)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise _bad(where, "a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise _bad(where, f"a list of {len(args)}", value)
        return tuple(_from_json(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _bad(where, "an object", value)
        return {k: _from_json(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(where, "a number", value)
    if tp in (int, str, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise _bad(where, tp.__name__, value)
    raise TypeError(f"manifest field type {tp!r} is not handled")  # a programming error, not user input


def _bad(where: str, expected: str, value: Any) -> ManifestError:
    return ManifestError(f"{where} should be {expected}, found {type(value).__name__}",
                         "the manifest is damaged or was edited by hand", "re-export the folder")
