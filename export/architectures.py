"""Registry of supported decoder architectures, keyed by the Hugging Face config's ``model_type``.

Each entry says where the parts the exporter cuts live in the transformers module tree and what context length the
exported graphs honour. Anything not listed is refused with the list of supported types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mirrorsd.errors import UnsupportedArchitectureError


def _plain_context(config: Any) -> int:
    return int(config.max_position_embeddings)


def _sliding_window_context(config: Any) -> int:
    # Our graphs build a full causal mask; beyond the sliding window the model would attend differently.
    window = getattr(config, "sliding_window", None) or config.max_position_embeddings
    return int(min(window, config.max_position_embeddings))


@dataclass(frozen=True)
class Architecture:
    """Where a decoder-only model keeps its embedding, layers, final norm, rotary embedding and LM head."""

    model_type: str
    family: str
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    lm_head: str = "lm_head"
    context_limit: Callable[[Any], int] = _plain_context

    def part(self, model: Any, dotted: str) -> Any:
        obj = model
        for attr in dotted.split("."):
            obj = getattr(obj, attr)
        return obj


ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        Architecture("llama", "Llama (Llama 2/3, SmolLM2, TinyLlama)"),
        Architecture("qwen2", "Qwen2 / Qwen2.5 (incl. Qwen2.5-Coder)", context_limit=_sliding_window_context),
        Architecture("qwen3", "Qwen3 (q/k norms inside attention)", context_limit=_sliding_window_context),
        Architecture("mistral", "Mistral", context_limit=_sliding_window_context),
    )
}


def architecture_for(model_type: str | None) -> Architecture:
    try:
        return ARCHITECTURES[str(model_type)]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"Model type '{model_type}' is not supported", f"mirrorsd-export knows: {supported}",
            "use a model of a supported architecture, or add an entry to mirrorsd.export.architectures") from None
