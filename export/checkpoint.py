"""A checkpoint's tensors, read one at a time and never all together: safetensors files or one GGUF file.

    reader = open_checkpoint(folder, gguf_file, config, skeleton)
    reader.shape(name)   -> the tensor's shape, from the header alone
    reader.get(name)     -> torch.Tensor in the checkpoint's own dtype (bf16, fp16, fp32; GGUF: dequantized fp32)

Names are the Hugging Face parameter names of the model (``model.layers.3.mlp.up_proj.weight``). A GGUF's names
and its Llama q/k row order are translated with transformers' own GGUF tables, tensor by tensor, so the values are
exactly what ``from_pretrained(gguf_file=...)`` would load. Opening checks every header (a truncated file fails
here, before any work); reading a tensor costs its own size only (no mmap stays resident).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mirrorsd.errors import ModelSourceError

SAFETENSORS_INDEX = "model.safetensors.index.json"


class TensorReader(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> torch.Tensor: ...


# safetensors dtype codes -> torch dtypes (the ones model weights use)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SafetensorsReader:
    """The ``*.safetensors`` files of a folder (or the ones its index names), read tensor by tensor.

    Reads with plain file reads into a fresh buffer: a memory map would keep every page it ever touched resident
    (and counted in RSS) for as long as it stays open."""

    tensors: dict[str, StoredTensor]

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        tensor = torch.empty(stored.shape, dtype=SAFETENSORS_DTYPES[stored.dtype])
        if tensor.numel():
            with open(stored.file, "rb") as handle:
                handle.seek(stored.start)
                got = handle.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
            if got != stored.end - stored.start:
                raise ModelSourceError(f"'{stored.file}' ended inside tensor '{name}'", "the file is truncated",
                                       "check that the download is complete (sizes, no truncated files)")
        return tensor


def open_safetensors(folder: Path) -> SafetensorsReader:
    from safetensors import safe_open

    index = folder / SAFETENSORS_INDEX
    files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else sorted(p.name for p in folder.glob("*.safetensors"))
    tensors = {}
    for file in files:
        path = folder / file
        try:
            with safe_open(str(path), framework="pt"):  # checks the header and that the data covers it
                pass
            tensors.update(_header(path))
        except ModelSourceError:
            raise
        except Exception as exc:  # SafetensorError (a truncated or damaged header), OSError
            raise ModelSourceError(f"Could not read the weights file '{path}'", _short(exc),
                                   "check that the download is complete (sizes, no truncated files)") from exc
    return SafetensorsReader(tensors)


def _header(path: Path) -> dict[str, StoredTensor]:
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    base, found = 8 + size, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ModelSourceError(f"'{path}' stores '{name}' as {entry['dtype']}",
                                   f"the exporter reads {', '.join(SAFETENSORS_DTYPES)}",
                                   "convert the checkpoint to float32, bfloat16 or float16 safetensors")
        start, end = entry["data_offsets"]
        found[name] = StoredTensor(path, entry["dtype"], tuple(entry["shape"]), base + start, base + end)
    return found


@dataclass(frozen=True)
class GGUFReader:
    """A GGUF file seen under Hugging Face names; each tensor is dequantized when it is read."""

    tensors: dict[str, Any]  # HF name -> gguf ReaderTensor
    memory_map: Any  # the mmap.mmap under gguf-py's numpy memmap
    processor: Any  # transformers' TensorProcessor of the architecture (Llama: undo the q/k row permutation)
    gguf_names: dict[str, str]  # HF name -> GGUF name

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[name].shape))  # GGUF lists dims innermost first

    def get(self, name: str) -> torch.Tensor:
        import mmap

        import numpy as np
        from gguf import dequantize

        tensor = self.tensors[name]
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = self.processor.process(weights=weights, name=self.gguf_names[name]).weights
        weights = np.array(weights, dtype=np.float32, order="C")  # a copy: nothing may point into the map
        if hasattr(mmap, "MADV_DONTNEED"):  # drop the pages just read from RSS (the file stays cached)
            self.memory_map.madvise(mmap.MADV_DONTNEED)
        return torch.from_numpy(weights)


def open_gguf(path: Path, skeleton) -> GGUFReader:
    from gguf import GGUFReader as RawReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    try:
        raw = RawReader(path)
    except Exception as exc:  # gguf-py raises ValueError/IndexError/struct errors on a damaged file
        raise ModelSourceError(f"Could not read the GGUF file '{path}'", _short(exc),
                               "check that the download is complete (sizes, no truncated files)") from exc
    hf_names = get_gguf_hf_weights_map(skeleton)  # GGUF name -> HF name
    architecture = read_field(raw, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=skeleton.config.to_dict())
    tensors, gguf_names = {}, {}
    for tensor in raw.tensors:
        if tensor.name in hf_names:
            tensors[hf_names[tensor.name]] = tensor
            gguf_names[hf_names[tensor.name]] = tensor.name
    return GGUFReader(tensors, raw.data._mmap, processor, gguf_names)


def parameter_sources(skeleton, reader: TensorReader) -> dict[str, str]:
    """Every parameter name of the model -> the checkpoint tensor holding it (tied weights share one tensor).

    Raises ModelSourceError when a parameter is missing or has another shape than the model's config says.
    """
    groups: dict[int, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        shapes[name] = tuple(param.shape)
    available, sources = reader.names(), {}
    for names in groups.values():
        stored = [n for n in names if n in available]
        if not stored:
            raise ModelSourceError(f"The checkpoint has no tensor '{names[0]}'",
                                   "every weight of the model's configuration must be stored",
                                   "check that the download is complete and that config.json belongs to it")
        sources.update({n: stored[0] for n in names})
    for name, source in sources.items():
        if reader.shape(source) != shapes[name]:
            raise ModelSourceError(f"The checkpoint's '{source}' has shape {reader.shape(source)}",
                                   f"the model's configuration needs {shapes[name]} for '{name}'",
                                   "check that config.json belongs to these weights")
    return sources


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
