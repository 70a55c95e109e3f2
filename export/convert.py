"""Convert a GGUF checkpoint into a plain Hugging Face folder once, so later loads skip dequantization.

    <cache>/gguf/<file>.gguf ─► transformers (dequantize to fp32) ─► <cache>/hf/.<name>.XXXX.tmp
                                                                  ─► rename ─► <cache>/hf/<name>

The folder holds fp32 safetensors, ``config.json`` (with a top-level ``rope_theta``), ``generation_config.json``,
the tokenizer files and ``mirrorsd_source.json`` (which GGUF it came from). It is written beside its final place and
renamed, so a folder is either complete or absent.

transformers 4.57 builds the tokenizer from GGUF metadata with a few losses, repaired here from the same metadata:
the Llama converter swaps in the BOS token for EOS and ignores ``add_bos_token``; the Qwen2 converter registers only
three of the control tokens (``<|fim_prefix|>`` and friends are split into pieces) and keeps ``<|endoftext|>`` as EOS
where the GGUF says ``<|im_end|>``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirrorsd.errors import ModelSourceError, OutputFolderError
from mirrorsd.weights import WeightSource, cache_lock, default_cache_dir, fetch_gguf, get_source

HF_SUBDIR = "hf"
SOURCE_RECORD = "mirrorsd_source.json"
FOLDER_MODE, FILE_MODE = 0o755, 0o644
CONVERT_FORMAT = 1  # bump when the folder layout or the repairs change, so cached folders are rebuilt

# GGUF token types (llama.cpp's enum): control tokens are special; user-defined ones are atomic but not special.
GGUF_TOKEN_CONTROL = 3
GGUF_TOKEN_USER_DEFINED = 4

# Tokenizer attribute -> GGUF metadata key holding its token id.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


@dataclass(frozen=True)
class GGUFTokenMeta:
    """What a GGUF says about its tokenizer and RoPE that transformers may lose on the way."""

    special_ids: dict[str, int]
    add_bos_token: bool | None
    atomic_tokens: dict[int, bool]  # token id -> special?, for control and user-defined tokens
    rope_theta: float | None


def read_gguf_token_meta(gguf_path: Path) -> GGUFTokenMeta:
    """Read special-token ids, ``add_bos_token``, control tokens and the RoPE base from a GGUF's metadata."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    arch = value("general.architecture")
    types = value("tokenizer.ggml.token_type") or []
    atomic = {i: t == GGUF_TOKEN_CONTROL for i, t in enumerate(types)
              if t in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)}
    special = {attr: value(key) for attr, key in SPECIAL_TOKEN_KEYS.items() if value(key) is not None}
    return GGUFTokenMeta(special_ids=special, add_bos_token=value("tokenizer.ggml.add_bos_token"),
                         atomic_tokens=atomic, rope_theta=value(f"{arch}.rope.freq_base") if arch else None)


def gguf_to_hf_folder(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                      progress: bool = True) -> Path:
    """Convert ``gguf_path`` into an fp32 Hugging Face folder at ``out_dir`` (which must not exist yet).

    Loads with ``low_cpu_mem_usage`` (peak RSS is about 1.3x the fp32 weights), writes
    into a temporary folder beside ``out_dir`` and renames it into place. Raises :class:`ModelSourceError` if
    transformers cannot read the file, :class:`OutputFolderError` if ``out_dir`` exists or cannot be written.
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise ModelSourceError(f"the GGUF file {gguf_path} does not exist", "there is nothing to convert",
                               "fetch it first (mirrorsd.weights.fetch_gguf) or pass the right path")
    if out_dir.exists():
        raise OutputFolderError(f"the output folder {out_dir} already exists",
                                "conversion never overwrites a folder", "delete it or choose another folder")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    except OSError as exc:
        raise OutputFolderError(f"cannot write beside {out_dir}", str(exc), "choose a writable folder") from exc
    try:
        meta = read_gguf_token_meta(gguf_path)
        _convert_into(gguf_path, tmp, meta, progress)
        _write_source_record(tmp, gguf_path)
        _make_readable(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def cached_hf_folder(name: str | WeightSource, cache_dir: str | os.PathLike[str] | None = None,
                     progress: bool = True) -> Path:
    """The HF folder ``<cache>/hf/<name>`` of a pinned model, fetched and converted on first use only."""
    source = get_source(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out_dir = root / HF_SUBDIR / source.name
    with cache_lock(root / HF_SUBDIR / f".{source.name}.lock"):
        if _is_current(out_dir, source):
            return out_dir
        gguf_path = fetch_gguf(source, root, progress)
        if out_dir.exists():  # from another GGUF or an older converter: move it aside, then delete it
            stale = Path(tempfile.mkdtemp(prefix=f".{source.name}.", suffix=".stale", dir=out_dir.parent))
            os.replace(out_dir, stale / source.name)
            shutil.rmtree(stale)
        return gguf_to_hf_folder(gguf_path, out_dir, progress)


def converted_from(folder: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a cached folder was converted from (``<cache>/gguf/<file>`` beside ``<cache>/hf/<name>``),
    when its record names one and the file there still has the recorded size; else None."""
    from mirrorsd.weights import GGUF_SUBDIR

    folder = Path(folder)
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text(encoding="utf-8"))
        name, size = str(record["gguf_file"]), int(record["gguf_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = folder.parent.parent / GGUF_SUBDIR / name
    if Path(name).name != name or not path.is_file() or path.stat().st_size != size:
        return None
    return path


def _is_current(out_dir: Path, source: WeightSource) -> bool:
    record_path = out_dir / SOURCE_RECORD
    if not record_path.is_file():
        return False
    from mirrorsd.errors import ModelSourceError
    from mirrorsd.user_files import JSON_LIMIT, read_json

    try:
        record = read_json(record_path, JSON_LIMIT, lambda why: ModelSourceError(f"Cannot read {record_path}", why))
    except ModelSourceError:  # a damaged record: the folder is converted again
        return False
    if not isinstance(record, dict):
        return False
    return (record.get("gguf_file"), record.get("gguf_size"), record.get("format")) == (
        source.filename, source.size, CONVERT_FORMAT)


def _convert_into(gguf_path: Path, folder: Path, meta: GGUFTokenMeta, progress: bool) -> None:
    """Load the GGUF with transformers, repair what it lost, and save everything into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    try:
        with _transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                         low_cpu_mem_usage=True, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelSourceError(f"transformers could not load {gguf_path}", str(exc).splitlines()[0] if str(exc)
                               else type(exc).__name__,
                               "check that the file is a complete GGUF of a supported architecture; delete it "
                               "from the cache to fetch it again") from exc
    _repair_tokenizer(tokenizer, meta)
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _ensure_top_level_rope_theta(folder / "config.json", model.config, meta.rope_theta)


def repair_gguf_tokenizer(tokenizer: Any, gguf_path: Path) -> None:
    """Fix, in place, what transformers' GGUF tokenizer conversion gets wrong (special tokens, BOS, control tokens)."""
    _repair_tokenizer(tokenizer, read_gguf_token_meta(Path(gguf_path)))


def _repair_tokenizer(tokenizer: Any, meta: GGUFTokenMeta) -> None:
    """Make the tokenizer's special tokens, BOS policy and atomic tokens match the GGUF metadata."""
    from tokenizers import AddedToken

    for attr, token_id in meta.special_ids.items():
        setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
    if meta.add_bos_token is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = meta.add_bos_token  # the Llama fast tokenizer rebuilds its post-processor
    known = tokenizer.added_tokens_decoder
    missing = {i: special for i, special in meta.atomic_tokens.items() if i not in known}
    size = len(tokenizer)
    for special in (True, False):
        tokens = [AddedToken(tokenizer.convert_ids_to_tokens(i), special=special, normalized=False)
                  for i, is_special in missing.items() if is_special == special]
        if tokens:
            tokenizer.add_tokens(tokens, special_tokens=special)
    moved = [i for i in missing if tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(i)) != i]
    if len(tokenizer) != size or moved:
        raise ModelSourceError("registering the GGUF's control tokens changed the vocabulary",
                               f"vocabulary size {size} -> {len(tokenizer)}, ids moved: {moved[:5]}",
                               "report this with the GGUF file name; the tokenizer conversion needs a fix")


def _ensure_top_level_rope_theta(config_path: Path, config: Any, gguf_theta: float | None) -> None:
    """transformers 4.57 falls back to a default RoPE base silently when ``rope_theta`` is absent: always write it."""
    data = json.loads(config_path.read_text())
    theta = data.get("rope_theta") or getattr(config, "rope_theta", None) or (
        getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None or (gguf_theta is not None and abs(float(theta) - gguf_theta) > 1e-6 * gguf_theta):
        raise ModelSourceError(f"the converted config has rope_theta {theta}, the GGUF says {gguf_theta}",
                               "a wrong RoPE base gives a model that runs but answers wrongly",
                               "report this with the GGUF file name")
    if data.get("rope_theta") != theta:
        data["rope_theta"] = theta
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a 0700 folder and safetensors 0600 files; a shared cache should be readable by all."""
    os.chmod(folder, FOLDER_MODE)
    for path in folder.iterdir():
        os.chmod(path, FILE_MODE)


def _write_source_record(folder: Path, gguf_path: Path) -> None:
    import transformers

    record = {"format": CONVERT_FORMAT, "gguf_file": gguf_path.name, "gguf_size": gguf_path.stat().st_size,
              "transformers": transformers.__version__, "dtype": "float32"}
    (folder / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' progress bars (including the GGUF dequantization one); restore on exit."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    saved_tqdm = gguf_utils.tqdm
    if not enabled:
        hf_logging.disable_progress_bar()
        gguf_utils.tqdm = functools.partial(saved_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = saved_tqdm
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
