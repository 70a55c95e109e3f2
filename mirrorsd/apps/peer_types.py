"""What the bench's peers share: their modes, models, outputs and errors (mirrorsd/apps/peers.py runs the
transformers and OpenVINO GenAI peers, mirrorsd/apps/peers_llamacpp.py llama.cpp's server)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import MirrorSDError

PEER_MODES = {  # bench mode -> (peer family, speculative?)
    "hf-ar": ("transformers", False),
    "hf-assisted": ("transformers", True),
    "ov-ar": ("openvino-genai", False),
    "ov-sd": ("openvino-genai", True),
    "ov-user-ar": ("openvino-genai-user", False),
    "ov-user-sd": ("openvino-genai-user", True),
    "ov-user-sd-conf": ("openvino-genai-user", True),
    "llama-ar": ("llama.cpp", False),
    "llama-sd": ("llama.cpp", True),
    "llama-ngram": ("llama.cpp", True),
}
INSTALL_HINT = 'install the peers: bash scripts/setup.sh --peers (or pip install -e ".[export,peers]" torch==2.13.0)'


class PeerUnavailableError(MirrorSDError):
    """A peer system the bench was asked to run is not installed or cannot load the models."""


@dataclass(frozen=True)
class PeerModels:
    target: Path  # Hugging Face folder of the target
    draft: Path  # Hugging Face folder of the draft
    target_precision: str = "fp32"
    draft_precision: str = "fp32"
    target_gguf: Path | None = None  # llama.cpp's files (default: the GGUF each folder was converted from)
    draft_gguf: Path | None = None


@dataclass(frozen=True)
class PeerOutput:
    tokens: list[int]
    stats: dict  # GenerationStats.to_dict() keys; NaN where the peer does not say


def peer_stats(mode: str, prompt_tokens: int, tokens: list[int], eos_ids: tuple[int, ...], seconds: float,
               ttft: float = math.nan) -> dict:
    """Statistics of a peer's generation of ``tokens`` (cut at EOS, see cut_at_eos): what a peer does not
    report stays NaN; it stopped at an EOS token, else at the token budget."""
    from mirrorsd.runtime.stats import GenerationStats

    nan, new_tokens = math.nan, len(tokens)
    decode = (new_tokens - 1) / (seconds - ttft) if new_tokens > 1 and seconds > ttft else nan
    return GenerationStats(
        mode=mode, prompt_tokens=prompt_tokens, new_tokens=new_tokens, seconds=seconds, time_to_first_token_s=ttft,
        tokens_per_second=new_tokens / max(seconds, 1e-9), decode_tokens_per_second=decode,
        mean_accepted_tokens=nan, acceptance_rate=nan, reuse_rate=nan, fallback_rate=nan,
        steps=0, drafted=0, accepted=0, windows=0, reused=0, fallbacks=0, draft_forwards=0,
        draft_forwards_per_window=nan, branches_rolled_out=0, draft_failures=0, target_busy_s=nan,
        draft_busy_s=nan, draft_hidden_s=nan, overlap_ratio=nan,
        finish_reason="eos" if tokens and tokens[-1] in eos_ids else "length",
        placement={"peer": PEER_MODES[mode][0]}).to_dict()


def cut_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """Up to and including the first EOS, as mirrorsd's decoders return them."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens
