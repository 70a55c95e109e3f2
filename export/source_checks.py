"""Checks on a model source before and after transformers reads it: a config that is an object of sane numbers and
fits this machine, weights that cover every layer the config claims, and a draft whose vocabulary is the target's.

    config.json   a JSON object; sizes are positive integers; fp32 weights must fit in this machine's memory
                  (a config claiming 10^9 layers is refused before anything is allocated)
    weights       the safetensors headers (read, never the tensors) hold exactly the layers the config claims; after
                  loading, transformers must report no missing weight (else random weights would be exported)
    draft         same vocabulary size (LM head rows) and the same tokenizer (entries and tokenization) as the target
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from mirrorsd.errors import IncompatibleDraftError, ModelSourceError
from mirrorsd.runtime.limits import machine_memory

SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
               "max_position_embeddings")
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors JSON header; real ones are well under 1 MB per file
LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PROBE_TEXT = "def f(x):\n    return x * 2  # Größe, 数字 123, émoji 🙂\n\tEnd.  "  # code, digits, scripts, spaces


def check_config_object(raw: Any, path: Path) -> dict:
    """``raw``: the parsed config.json. Must be an object whose size fields are positive integers that fit."""
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{path} does not hold a JSON object", f"it holds a {type(raw).__name__}",
                               "restore the model's config.json")
    check_sizes(raw, path)
    return raw


def check_sizes(values: dict, where: Path | str) -> None:
    """Positive integer sizes, and an fp32 parameter count that this machine's memory can hold."""
    for key in SIZE_FIELDS:
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelSourceError(f"{key} = {value!r} in {where} is not a positive integer",
                                   "the configuration is damaged", "restore the model's config.json")
    need, have = fp32_bytes(values), machine_memory()
    if have is not None and need > have:
        raise ModelSourceError(
            f"{where} describes a model of {need / 2**30:,.1f} GiB in fp32 "
            f"({values.get('num_hidden_layers')} layers, hidden size {values.get('hidden_size')})",
            f"the export holds it in memory, and this machine has {have / 2**30:.1f} GiB",
            "check num_hidden_layers and the other sizes in config.json against the weights")


def fp32_bytes(values: dict) -> int:
    """A lower bound of the parameter bytes a config describes (embedding + attention + MLP per layer)."""
    get = lambda key: values.get(key) if isinstance(values.get(key), int) else 1  # noqa: E731
    hidden, layers = get("hidden_size"), get("num_hidden_layers")
    per_layer = 2 * hidden * hidden + 3 * hidden * get("intermediate_size")  # q + o, up/gate/down (k, v smaller)
    return 4 * (get("vocab_size") * hidden + layers * per_layer)


def check_layer_coverage(folder: Path, claimed: int) -> None:
    """The safetensors files transformers will read must hold layers 0..claimed-1, no more and no fewer."""
    files = _weight_files(folder)
    if not files:
        return  # transformers reports a folder without weights itself
    layers = set()
    for file in files:
        layers |= {int(m.group(1)) for name in _tensor_names(file) if (m := LAYER_NAME.search(name))}
    if layers != set(range(claimed)):
        held = f"layers 0..{max(layers)}" if layers == set(range(len(layers))) and layers else \
            f"{len(layers)} layer indices"
        raise ModelSourceError(
            f"config.json of '{folder}' says {claimed} layers, and its weights hold {held}",
            "the missing layers would be exported with random weights (or extra ones silently dropped)",
            "use the config.json that belongs to these weights, or complete the download")


def check_nothing_missing(loading_info: dict, path: Path) -> None:
    missing = list(loading_info.get("missing_keys") or [])
    if missing:
        raise ModelSourceError(f"The weights of '{path}' do not cover its config: {len(missing)} tensor(s) missing, "
                               f"e.g. {', '.join(sorted(missing)[:3])}",
                               "transformers would fill them with random values",
                               "use the config.json that belongs to these weights, or complete the download")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return sorted({folder / name for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelSourceError(f"{index} is damaged", f"{type(exc).__name__}: {exc}",
                                   "check that the download is complete") from None
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _tensor_names(file: Path) -> list[str]:
    """Tensor names from a safetensors header (8-byte little-endian length, then JSON), without the tensors."""
    def damaged(why: str) -> ModelSourceError:
        return ModelSourceError(f"Could not read the weights of '{file}'", why,
                                "check that the download is complete (sizes, no truncated files)")

    try:
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise damaged("the file is shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, file.stat().st_size - 8):
                raise damaged(f"its header claims {length} bytes")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise damaged(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    return [name for name in header if name != "__metadata__"]


def check_same_vocabulary(target, draft) -> None:
    """The draft must have the target's LM head rows and map every token id to the same string, tokenizing alike."""
    if draft.info.vocab_size != target.info.vocab_size:
        raise IncompatibleDraftError(
            f"The draft's vocabulary has {draft.info.vocab_size} rows and the target's {target.info.vocab_size}",
            "draft tokens must be target token ids and back (a mismatch fails inside the graphs at run time)",
            "pick a draft of the same model family with the same vocabulary size, or use --draft-layers K")
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        raise IncompatibleDraftError(
            f"The draft '{draft.path}' has another vocabulary than the target '{target.path}'",
            f"{only_t} of the target's {len(t_vocab)} token entries differ or are missing in the draft",
            "pick a draft of the same model family (same tokenizer), or use --draft-layers K")
    t_ids = target.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    d_ids = draft.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if t_ids != d_ids:
        raise IncompatibleDraftError(
            f"The draft '{draft.path}' tokenizes text differently from the target '{target.path}'",
            f"a probe text gives {len(d_ids)} draft ids and {len(t_ids)} target ids, not the same ones",
            "pick a draft with the target's tokenizer (same merges and pre-tokenizer)")
