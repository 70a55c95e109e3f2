"""Check every exported graph against PyTorch before the folder is published.

Checks (batch of 2, the second row left-padded):
    split      prefix -> suffix logits over a whole sequence  vs  the PyTorch model's logits
    exit_head  top-k log-probs of the exit head               vs  PyTorch norm + LM head on h(L)
    cached     prefix/suffix run in two chunks with KV        vs  PyTorch logits of the same positions
    draft      draft logits, whole and in two chunks          vs  the PyTorch draft
Tolerance per check: |onnx - torch| <= atol + rtol * max|torch| (fp32 graphs; the table is in TOLERANCES).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mirrorsd import names
from mirrorsd.errors import ValidationError

TOLERANCES = {  # check -> (atol, rtol); fp32 ONNX vs fp32 PyTorch differ only by kernel summation order
    "split_hidden": (1e-4, 1e-4),
    "split_logits": (1e-4, 1e-4),
    "exit_topk_logprobs": (1e-4, 1e-4),
    "cached_logits": (1e-4, 1e-4),
    "draft_logits": (1e-4, 1e-4),
    "draft_cached_logits": (1e-4, 1e-4),
    "draft_static_logits": (1e-4, 1e-4),  # the static draft fed one token at a time through its fixed buffer
    "draft_streaming_logits": (1e-4, 1e-4),  # streaming draft, main stream vs the plain PyTorch draft
    "draft_streaming_cached_logits": (1e-4, 1e-4),
    "draft_streaming_stream_logits": (1e-4, 1e-4),  # streams vs the training path of the same module
}
SEQ_LEN, SPLIT_AT, PAD = 9, 5, 2


@dataclass(frozen=True)
class Check:
    name: str
    max_abs_diff: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.max_abs_diff)) and self.max_abs_diff <= self.tolerance


def sample_batch(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(2, SEQ_LEN), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :PAD] = 0  # left padding on the second row
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    return ids, mask, positions


def compare(name: str, got: np.ndarray, want: np.ndarray, valid: np.ndarray) -> Check:
    """Max abs difference over valid (non-padding) positions; ``valid`` is [B, S] of 0/1."""
    atol, rtol = TOLERANCES[name]
    sel = valid.astype(bool)
    diff = float(np.max(np.abs(got[sel] - want[sel]))) if sel.any() else 0.0
    return Check(name, diff, atol + rtol * float(np.max(np.abs(want[sel]))))


class GraphRunner:
    """Runs one exported ONNX graph with its KV inputs (empty past by default)."""

    def __init__(self, path, kv_layers: range, kv_heads: int, head_dim: int) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.kv_layers, self.kv_heads, self.head_dim = kv_layers, kv_heads, head_dim

    def run(self, first, mask, positions, past=None):
        feeds = {self.session.get_inputs()[0].name: first, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        batch = first.shape[0]
        for j, layer in enumerate(self.kv_layers):
            for k, template in enumerate((names.PAST_KEY, names.PAST_VALUE)):
                empty = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)
                feeds[template % layer] = past[2 * j + k] if past is not None else empty
        out = self.session.run(None, feeds)
        return out[0], out[1:]


def torch_reference(source, ids, mask, positions, num_layers: int, exit_layer: int | None):
    """(logits of the first ``num_layers`` layers + head, hidden state after ``exit_layer``) from PyTorch."""
    arch, model = source.arch, source.model
    with torch.no_grad():
        out = model.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                          position_ids=torch.from_numpy(positions), output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states
        total = len(hidden) - 1
        last = out.last_hidden_state if num_layers == total else arch.part(model, arch.final_norm)(hidden[num_layers])
        logits = arch.part(model, arch.lm_head)(last).numpy()
        exit_hidden = hidden[exit_layer].numpy() if exit_layer is not None else None
    return logits, exit_hidden


def validate_target(folder, source, exit_layer: int, top_k: int) -> list[Check]:
    info = source.info
    prefix = GraphRunner(folder / "prefix.onnx", range(0, exit_layer), info.num_kv_heads, info.head_dim)
    suffix = GraphRunner(folder / "suffix.onnx", range(exit_layer, info.num_layers), info.num_kv_heads, info.head_dim)
    ids, mask, pos = sample_batch(info.vocab_size)
    want_logits, want_hidden = torch_reference(source, ids, mask, pos, info.num_layers, exit_layer)
    hidden, _ = prefix.run(ids, mask, pos)
    logits, _ = suffix.run(hidden, mask, pos)
    checks = [compare("split_hidden", hidden, want_hidden, mask), compare("split_logits", logits, want_logits, mask)]
    checks.append(_check_exit_head(folder, source, hidden, want_hidden, mask, top_k))
    # Two chunks: KV of the first chunk feeds the second.
    a, b = slice(0, SPLIT_AT), slice(SPLIT_AT, SEQ_LEN)
    h1, p_kv = prefix.run(ids[:, a], mask[:, a], pos[:, a])
    _, s_kv = suffix.run(h1, mask[:, a], pos[:, a])
    h2, _ = prefix.run(ids[:, b], mask, pos[:, b], p_kv)
    logits2, _ = suffix.run(h2, mask, pos[:, b], s_kv)
    checks.append(compare("cached_logits", logits2, want_logits[:, b], mask[:, b]))
    return checks


def _check_exit_head(folder, source, hidden, want_hidden, mask, top_k) -> Check:
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "exit_head.onnx"), providers=["CPUExecutionProvider"])
    ids, logprobs = session.run(None, {names.HIDDEN_STATES: hidden})
    arch, model = source.arch, source.model
    with torch.no_grad():
        ref = torch.log_softmax(arch.part(model, arch.lm_head)(arch.part(model, arch.final_norm)(
            torch.from_numpy(want_hidden))), dim=-1)
        want = torch.topk(ref, top_k, dim=-1).values.numpy()
    return compare("exit_topk_logprobs", logprobs, want, mask)


def validate_draft(folder, draft_source) -> list[Check]:
    info = draft_source.info
    draft = GraphRunner(folder / "draft.onnx", range(0, info.num_layers), info.num_kv_heads, info.head_dim)
    ids, mask, pos = sample_batch(info.vocab_size, seed=1)
    want, _ = torch_reference(draft_source, ids, mask, pos, info.num_layers, None)
    logits, _ = draft.run(ids, mask, pos)
    a, b = slice(0, SPLIT_AT), slice(SPLIT_AT, SEQ_LEN)
    _, kv = draft.run(ids[:, a], mask[:, a], pos[:, a])
    logits2, _ = draft.run(ids[:, b], mask, pos[:, b], kv)
    return [compare("draft_logits", logits, want, mask), compare("draft_cached_logits", logits2, want[:, b], mask[:, b])]


def require_all_passed(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.passed]
    if failed:
        detail = "; ".join(f"{c.name}: max |diff| {c.max_abs_diff:.3g} > {c.tolerance:.3g}" for c in failed)
        raise ValidationError("Exported graphs disagree with PyTorch", detail,
                              "report this with the model and options used; nothing was written")


def split_logits(folder, info, exit_layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of prefix -> suffix on the validation batch, and its mask (to compare precisions)."""
    prefix = GraphRunner(folder / "prefix.onnx", range(0, exit_layer), info.num_kv_heads, info.head_dim)
    suffix = GraphRunner(folder / "suffix.onnx", range(exit_layer, info.num_layers), info.num_kv_heads, info.head_dim)
    ids, mask, pos = sample_batch(info.vocab_size)
    hidden, _ = prefix.run(ids, mask, pos)
    return suffix.run(hidden, mask, pos)[0], mask


def draft_logits(folder, info) -> tuple[np.ndarray, np.ndarray]:
    draft = GraphRunner(folder / "draft.onnx", range(0, info.num_layers), info.num_kv_heads, info.head_dim)
    ids, mask, pos = sample_batch(info.vocab_size, seed=1)
    return draft.run(ids, mask, pos)[0], mask


def quantization_effect(before: np.ndarray, after: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How far quantized logits moved from fp32 ones (recorded, not a pass/fail: only non-finite output fails)."""
    sel = mask.astype(bool)
    if not np.isfinite(after[sel]).all():
        raise ValidationError("A quantized graph produced non-finite logits", "the quantizer broke the graph",
                              "export with --precision fp32 and report the model")
    agree = float(np.mean(np.argmax(before[sel], -1) == np.argmax(after[sel], -1)))
    return {"quant_max_abs_diff": float(np.max(np.abs(before[sel] - after[sel]))), "quant_top1_agreement": agree}
