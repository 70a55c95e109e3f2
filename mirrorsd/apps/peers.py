"""The systems a user would pick instead of mirrorsd, run by ``mirrorsd bench`` on the same prompt token ids.

``hf-ar`` / ``hf-assisted``
    transformers ``generate()`` on the export's own Hugging Face source folders, fp32 (what the export was traced
    from): the target alone, and assisted generation with the draft as ``assistant_model`` (transformers' defaults
    for the assistant schedule, which is what a user gets).
``ov-ar`` / ``ov-sd``
    OpenVINO GenAI ``LLMPipeline`` on the same folders converted by optimum-intel (cached under
    ``~/.cache/mirrorsd/openvino``): the target alone, and speculative decoding with ``draft_model`` and
    ``num_assistant_tokens = gamma``. Weights use the export's precisions (fp32 -> fp32, int8/int4 -> NNCF
    weight compression); on CPU inference precision is forced to f32 so the numbers compare with ours (OpenVINO's
    default there is bf16).
``ov-user-ar`` / ``ov-user-sd`` / ``ov-user-sd-conf``
    OpenVINO GenAI as a user runs it: both folders converted by ``optimum-cli export openvino --weight-format int4``
    with optimum-intel's defaults for everything else, and the device's default inference precision (bf16 on CPUs
    with AVX-512 BF16 or AMX, f32 elsewhere; the report names it). The target alone, speculative decoding with
    ``num_assistant_tokens = gamma``, and with ``assistant_confidence_threshold = OV_CONFIDENCE_THRESHOLD``
    (the draft proposes while its confidence stays above it).
``llama-ar`` / ``llama-sd`` / ``llama-ngram``
    llama.cpp's server on the GGUF files the export was converted from (see ``mirrorsd.apps.peers_llamacpp``).

Every peer uses all cores (its default): the bench's ``ar`` baseline gives each ONNX Runtime session
``--threads``, so read peer rows against ``ar-Nt`` (``--baseline-threads``) as well. Only wall time, token ids and
what a peer reports are known: acceptance columns stay empty (NaN) unless the peer exposes them.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mirrorsd.devices.openvino_import import load_openvino
from mirrorsd.errors import GenerationInputError
from mirrorsd.apps.peer_types import (INSTALL_HINT, PEER_MODES, PeerModels, PeerOutput,  # noqa: F401 (re-exported)
                                     PeerUnavailableError, cut_at_eos, peer_stats)

OV_WEIGHT_FORMATS = {"fp32": ["--weight-format", "fp32"], "fp16": ["--weight-format", "fp16"],
                     "int8": ["--weight-format", "int8"],
                     "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0", "--sym"],
                     "int4-default": ["--weight-format", "int4"]}  # optimum-intel's own int4 defaults (ov-user-*)
OV_CONFIDENCE_THRESHOLD = 0.4  # ov-user-sd-conf: GenAI's assistant_confidence_threshold
OV_USER_PRECISION = "int4-default"


def is_peer_mode(mode: str) -> bool:
    return mode in PEER_MODES


def hf_folder(path: str | os.PathLike, role: str) -> Path:
    """A Hugging Face model folder (config.json + weights), or a clear error naming the override flag."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise PeerUnavailableError(
            f"The {role} source '{folder}' is not a Hugging Face model folder",
            "peers load the models the export came from, as Hugging Face folders",
            f"pass --peer-{role} with the {role}'s folder (mirrorsd fetch converts pinned GGUFs to folders)")
    return folder


class TransformersPeer:
    """transformers ``generate()``: greedy, fp32, transformers' default attention (sdpa)."""

    def __init__(self, models: PeerModels, eos_ids: tuple[int, ...]) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise PeerUnavailableError("transformers is not installed", str(exc), INSTALL_HINT) from exc
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.eos_ids = tuple(eos_ids)
        load = lambda folder: AutoModelForCausalLM.from_pretrained(  # noqa: E731
            str(folder), torch_dtype=torch.float32).eval()
        self.target = load(models.target)
        self.draft = load(models.draft)

    def generate(self, mode: str, ids: list[int], max_new_tokens: int, gamma: int) -> PeerOutput:
        torch = self.torch
        input_ids = torch.tensor([ids], dtype=torch.long)  # [1, prompt]
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=list(self.eos_ids),
                      pad_token_id=self.eos_ids[0], attention_mask=torch.ones_like(input_ids),
                      temperature=None, top_p=None, top_k=None)
        if PEER_MODES[mode][1]:
            kwargs["assistant_model"] = self.draft
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(input_ids, **kwargs)  # [1, prompt + new]
        seconds = time.perf_counter() - start
        tokens = cut_at_eos([int(t) for t in out[0, len(ids):]], self.eos_ids)
        return PeerOutput(tokens, peer_stats(mode, len(ids), tokens, self.eos_ids, seconds))

    def close(self) -> None:
        self.target = self.draft = None


def openvino_cache() -> Path:
    return Path(os.environ.get("MIRRORSD_CACHE", Path.home() / ".cache" / "mirrorsd")) / "openvino"


def convert_to_openvino(source: Path, precision: str, progress: bool = True) -> Path:
    """optimum-intel's conversion of an HF folder to an OpenVINO IR folder GenAI can load; cached, atomic."""
    if precision not in OV_WEIGHT_FORMATS:
        raise PeerUnavailableError(f"No OpenVINO weight format for precision '{precision}'",
                                   f"known: {', '.join(OV_WEIGHT_FORMATS)}", "export with one of those")
    resolved = source.resolve()
    key = f"{resolved.name}-{precision}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:10]}"
    out = openvino_cache() / key
    if (out / "openvino_model.xml").is_file() and (out / "openvino_tokenizer.xml").is_file():
        return out
    cli = shutil.which("optimum-cli") or str(Path(sys.executable).with_name("optimum-cli"))
    if not Path(cli).exists():
        raise PeerUnavailableError("optimum-cli (optimum-intel) is not installed",
                                   "OpenVINO GenAI loads OpenVINO IR that optimum-intel converts", INSTALL_HINT)
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    command = [cli, "export", "openvino", "--model", str(resolved), "--task", "text-generation-with-past",
               *OV_WEIGHT_FORMATS[precision], str(scratch)]
    if progress:
        print(f"converting {resolved.name} to OpenVINO IR ({precision}) for the ov-* peers ...", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (scratch / "openvino_model.xml").is_file():
        shutil.rmtree(scratch, ignore_errors=True)
        raise PeerUnavailableError(f"optimum-intel could not convert {resolved}", done.stderr.strip()[-800:],
                                   "check the folder loads with transformers; see the message above")
    scratch.replace(out)
    return out


class OpenVINOGenAIPeer:
    """OpenVINO GenAI's LLMPipeline on CPU, with and without ``draft_model``: with f32 inference precision and the
    export's weight precisions (``user=False``: ov-ar, ov-sd), or as a user runs it (``user=True``: optimum-cli's
    int4 defaults, the device's default inference precision; ov-user-*)."""

    def __init__(self, models: PeerModels, eos_ids: tuple[int, ...], speculative: bool, progress: bool = True,
                 user: bool = False):
        try:
            ov = load_openvino()
            import openvino_genai
        except ImportError as exc:
            raise PeerUnavailableError("openvino-genai is not installed", str(exc), INSTALL_HINT) from exc
        self.ov, self.eos_ids = ov, tuple(eos_ids)
        properties = {} if user else {"INFERENCE_PRECISION_HINT": "f32"}
        self.inference_precision = properties.get("INFERENCE_PRECISION_HINT") or default_inference_precision(ov)
        target = convert_to_openvino(models.target, OV_USER_PRECISION if user else models.target_precision, progress)
        self.pipes = {False: openvino_genai.LLMPipeline(str(target), "CPU", **properties)}
        if speculative:
            draft = convert_to_openvino(models.draft, OV_USER_PRECISION if user else models.draft_precision, progress)
            self.pipes[True] = openvino_genai.LLMPipeline(
                str(target), "CPU", draft_model=openvino_genai.draft_model(str(draft), "CPU", **properties),
                **properties)

    def generate(self, mode: str, ids: list[int], max_new_tokens: int, gamma: int) -> PeerOutput:
        import numpy as np

        speculative = PEER_MODES[mode][1]
        pipe = self.pipes[speculative]
        config = pipe.get_generation_config()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        config.eos_token_id = self.eos_ids[0]
        config.stop_token_ids = set(self.eos_ids)
        if speculative:
            config.num_assistant_tokens, config.assistant_confidence_threshold = assistant_schedule(mode, gamma)
        input_ids = self.ov.Tensor(np.asarray([ids], dtype=np.int64))  # [1, prompt]
        start = time.perf_counter()
        result = pipe.generate(input_ids, config)
        seconds = time.perf_counter() - start
        tokens = cut_at_eos([int(t) for t in result.tokens[0]], self.eos_ids)
        ttft = math.nan
        try:
            ttft = float(result.perf_metrics.get_ttft().mean) / 1000.0  # ms -> s
        except (AttributeError, RuntimeError):
            pass
        stats = peer_stats(mode, len(ids), tokens, self.eos_ids, seconds, ttft=ttft)
        stats["placement"]["inference_precision"] = self.inference_precision
        return PeerOutput(tokens, stats)

    def close(self) -> None:
        self.pipes.clear()


def assistant_schedule(mode: str, gamma: int) -> tuple[int, float]:
    """GenAI's (num_assistant_tokens, assistant_confidence_threshold) for a speculative ov-* mode: a fixed window
    of ``gamma`` tokens, or (ov-user-sd-conf) a window that ends where the draft's confidence drops below the
    threshold. GenAI takes exactly one of the two (the other 0)."""
    if mode == "ov-user-sd-conf":
        return 0, OV_CONFIDENCE_THRESHOLD
    return gamma, 0.0


def default_inference_precision(ov) -> str:
    """What OpenVINO's CPU plugin computes in when nobody says (bf16 where the CPU has AVX-512 BF16 or AMX)."""
    try:
        value = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")  # an openvino Type, e.g. bf16
    except RuntimeError:
        return "unknown"
    return value.get_type_name() if hasattr(value, "get_type_name") else str(value)


def families(modes: list[str]) -> dict[str, list[str]]:
    """Peer modes grouped by the system that runs them, in first-mentioned order."""
    grouped: dict[str, list[str]] = {}
    for mode in modes:
        if mode not in PEER_MODES:
            raise GenerationInputError(f"'{mode}' is not a peer mode", f"peers are {', '.join(PEER_MODES)}",
                                       "pick from those")
        grouped.setdefault(PEER_MODES[mode][0], []).append(mode)
    return grouped


def open_peer(family: str, modes: list[str], models: PeerModels, eos_ids: tuple[int, ...], progress: bool = True):
    """One loaded peer that runs every mode in ``modes`` (all of one family). Load it, use it, ``close()`` it:
    the bench runs one family at a time so that at most one more copy of the target is in memory."""
    if family == "transformers":
        return TransformersPeer(models, eos_ids)
    if family == "llama.cpp":
        from mirrorsd.apps.peers_llamacpp import LlamaCppPeer

        return LlamaCppPeer(models, eos_ids, modes)
    speculative = any(PEER_MODES[m][1] for m in modes)
    return OpenVINOGenAIPeer(models, eos_ids, speculative, progress, user=family == "openvino-genai-user")
