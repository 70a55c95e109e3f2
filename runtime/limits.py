"""What this machine can hold, checked before anything is allocated, and logits checked as they arrive.

    check_threads(request)                 intra-op threads 1..cores: more only queue on the same cores (and a
                                           million of them never finish starting)
    check_generation(config, manifest, n)  runner_up_k within the vocabulary; gamma within the context; the KV
                                           caches and logits a request needs (gamma, branch_batch, the context)
                                           within this machine's memory
    check_vocabularies(manifest)           draft and target logits of one width (an older export may differ)
    check_finite(logits)                   NaN or infinite target logits are an error, not token 0 forever
"""
from __future__ import annotations

import os

import numpy as np

from mirrorsd.errors import GenerationInputError, ManifestError, ModelOutputError
from mirrorsd.ranges import cores  # noqa: F401 - the cores this process may use (imported from here too)

BYTES = 4  # float32 KV caches and logits


def machine_memory() -> int | None:
    """Physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None




def check_threads(request) -> None:
    """``request``: a DeviceRequest. Thread counts must be 1..cores."""
    for name, value in (("--threads (target)", request.target_threads), ("--threads (draft)", request.draft_threads)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cores():
            raise GenerationInputError(f"{name} {value!r} is out of range",
                                       f"this machine gives the process {cores()} cores; more threads only queue",
                                       f"pass 1..{cores()}, or leave it out (every core for each model)")


def check_generation(config, manifest, prompt_tokens: int, context_limit: int) -> None:
    """Bounds of a GenerationConfig that depend on the export and the machine (the plain ranges are checked by
    GenerationConfig.check)."""
    vocab = manifest.draft.vocab_size
    if config.mode == "mirror" and config.runner_up_k > vocab:
        raise GenerationInputError(f"runner_up_k {config.runner_up_k} is larger than the vocabulary ({vocab})",
                                   "it counts the draft's candidate tokens per position",
                                   f"pass --runner-up-k 1..{vocab} (default 4)")
    if config.mode == "ar":
        return
    if config.gamma >= context_limit:
        raise GenerationInputError(f"gamma {config.gamma} is not below the context ({context_limit} tokens)",
                                   "a draft window must fit in the context with the prompt",
                                   "pass a gamma such as 4 (the default)")
    need, have = request_bytes(config, manifest, prompt_tokens, context_limit), machine_memory()
    if have is not None and need > have:
        raise GenerationInputError(
            f"This request needs about {need / 2**30:,.1f} GiB for its KV caches and logits",
            f"this machine has {have / 2**30:.1f} GiB (gamma {config.gamma}, branch_batch {config.branch_batch}, "
            f"context {context_limit})",
            "lower --gamma and --branch-batch (defaults 4 and 2)")


def request_bytes(config, manifest, prompt_tokens: int, context_limit: int) -> int:
    """A lower bound of the bytes the decoders allocate for one request (caches at their first size, logits)."""
    capacity = min(prompt_tokens + config.max_new_tokens, context_limit) + config.gamma + 2
    candidates = (config.gamma + 1) * (config.runner_up_k + manifest.top_k)  # (depth, token) pairs to branch on
    branch_rows = min(config.branch_batch, config.branches, candidates) if config.mode == "mirror" else 0
    rows = 1 + branch_rows  # the draft's main cache + the rows of one batched branch rollout

    def kv(info) -> int:
        return info.num_layers * 2 * info.num_kv_heads * info.head_dim * BYTES

    logits = (config.gamma + 1) * BYTES * (manifest.target.vocab_size + rows * manifest.draft.vocab_size)
    return capacity * (kv(manifest.target) + rows * kv(manifest.draft)) + logits


def check_vocabularies(manifest) -> None:
    if manifest.draft.vocab_size != manifest.target.vocab_size:
        raise ManifestError(
            f"The export's draft has {manifest.draft.vocab_size} vocabulary rows and its target "
            f"{manifest.target.vocab_size}", "draft tokens must be target token ids (the graphs fail otherwise)",
            "re-export with a draft of the same vocabulary (this mirrorsd-export checks it)")


def check_finite(logits: np.ndarray, model: str = "target") -> np.ndarray:
    if not np.isfinite(logits).all():
        bad = "NaN" if np.isnan(logits).any() else "infinite"
        raise ModelOutputError(f"The {model}'s logits hold {bad} values (NaN/Inf)",
                               "its graphs compute garbage (damaged weights, or a quantization that overflowed); "
                               "decoding on would emit a meaningless token forever",
                               "re-export the model (fp32 first) and check its source weights")
    return logits
