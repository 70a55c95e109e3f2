"""Check every exported graph against PyTorch before the folder is published.

Each graph module says what it checks and with which tolerance (graphs/base.py); this module gives them the
means: a validation batch (2 rows, the second left-padded), runs of a graph on it, the PyTorch reference, and the
comparison |onnx - torch| <= atol + rtol * max|torch| over the valid positions. Where that fails, the bound becomes
NOISE_FACTOR times PyTorch's own float32 error on the same batch, if larger: the larger of its variation between
thread counts (the reference again at one thread: another summation order) and twice its distance from the same
reference computed in float64 (each row alone, without its padding). A model whose activations reach the thousands (Qwen2.5-0.5B's first-token
"massive activations", ~2000) moves its logits by ~0.03 between two float32 summation orders, more than the fixed
bound, and a wrong graph moves them by far more than that. The thread variation alone is not enough: on some CPUs
PyTorch's one- and two-thread results are bitwise equal, which left such a model no allowance at all.

A graph runs from its file (FileRunner) or, when the file holds quantized weights and the fp32 graph never existed,
piece by piece in fp32 (chain_runner.py's ChainRunner: each layer's piece built again from the checkpoint, one at a
time). Either way a run is the same: graph inputs in, graph outputs out, the past KV empty or another run's presents.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mirrorsd import names
from mirrorsd.errors import ValidationError

SEQ_LEN, SPLIT_AT, PAD = 9, 5, 2
SEEDS = {"target": 0, "draft": 1}  # the validation batch of each model (the quantization effect uses it too)
NOISE_FACTOR = 2.0  # ONNX may differ from PyTorch by at most this times PyTorch's own float32 error


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


def compare(name: str, got: np.ndarray, want: np.ndarray, valid: np.ndarray, tolerance: tuple[float, float],
            noise=None) -> Check:
    """Max abs difference over valid (non-padding) positions; ``valid`` is [B, S] of 0/1. ``noise``: a callable
    giving PyTorch's own variation on these positions, asked only when the fixed bound fails (module docstring)."""
    atol, rtol = tolerance
    sel = valid.astype(bool)
    diff = float(np.max(np.abs(got[sel] - want[sel]))) if sel.any() else 0.0
    bound = atol + rtol * float(np.max(np.abs(want[sel]))) if sel.any() else atol
    if diff > bound and noise is not None:
        bound = max(bound, NOISE_FACTOR * float(noise()))
    return Check(name, diff, bound)


@dataclass(frozen=True)
class Run:
    """One call of a graph: its inputs by name; past KV empty, or the presents of the earlier run ``past_from``."""

    name: str
    feeds: dict[str, np.ndarray]
    past_from: str | None = None


def chunked(first_name: str, firsts: tuple, mask: np.ndarray, positions: np.ndarray) -> list[Run]:
    """Runs "full" (the whole batch), "a" (the first SPLIT_AT steps) and "b" (the rest, on a's KV).

    ``firsts`` = the first input for full, a and b (ids, or the hidden states a prefix returned for each)."""
    a, b = slice(0, SPLIT_AT), slice(SPLIT_AT, SEQ_LEN)
    step = lambda first, m, p: {first_name: first, names.ATTENTION_MASK: m, names.POSITION_IDS: p}  # noqa: E731
    return [Run("full", step(firsts[0], mask, positions)), Run("a", step(firsts[1], mask[:, a], positions[:, a])),
            Run("b", step(firsts[2], mask, positions[:, b]), past_from="a")]


def past_input(name: str, kv, run: Run, done: dict, batch: int) -> np.ndarray | None:
    """The past KV input ``name`` of ``run``: the matching present of run ``past_from``, or an empty one."""
    for i in kv.layer_indices() if kv is not None else ():
        for past, present in ((kv.past_key, kv.present_key), (kv.past_value, kv.present_value)):
            if name == past % i:
                if run.past_from is not None:
                    return done[run.past_from][present % i]
                return np.zeros((batch, kv.num_kv_heads, 0, kv.head_dim), np.float32)
    return None


def cpu_session(model, external: dict | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if external:
        opts.add_external_initializers(list(external), [ort.OrtValue.ortvalue_from_numpy(a) for a in external.values()])
    if isinstance(model, (str, Path)) and Path(model).is_file():  # packed weights: unpacked here, not by ONNX
        from mirrorsd.devices.backends import unpacked_for_session  # Runtime's folding (devices/unpack.py says why)

        model = unpacked_for_session(Path(model), opts) or model
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


class FileRunner:
    """A graph file in ONNX Runtime (CPU)."""

    def __init__(self, path: Path, kv) -> None:
        self.session, self.kv = cpu_session(str(path)), kv

    def run(self, runs: list[Run]) -> dict[str, dict[str, np.ndarray]]:
        done: dict[str, dict[str, np.ndarray]] = {}
        outputs = [o.name for o in self.session.get_outputs()]
        for run in runs:
            batch = next(iter(run.feeds.values())).shape[0]
            feeds = {i.name: run.feeds[i.name] if i.name in run.feeds else past_input(i.name, self.kv, run, done, batch)
                     for i in self.session.get_inputs()}
            done[run.name] = dict(zip(outputs, self.session.run(None, feeds)))
        return done


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


@dataclass
class Validation:
    """What a graph module's ``validate`` gets: its runner, the model, and what the model's other graphs left."""

    source: Any  # ModelSource (lazy: the reference loads a layer at a time)
    runner: Any  # FileRunner | ChainRunner
    exit_layer: int
    shared: dict = field(default_factory=dict)  # run results of earlier graphs by role, cached references

    def batch(self, model: str):
        return sample_batch(self.source.info.vocab_size, SEEDS[model])

    def reference(self, model: str, threads: int | None = None):
        """(logits, hidden state at the exit layer) of the whole model on its validation batch, computed once
        (``threads``: with PyTorch limited to that many threads, for noise())."""
        key = ("reference", model, threads)
        if key not in self.shared:
            ids, mask, pos = self.batch(model)
            exit_layer = self.exit_layer if model == "target" else None
            before = torch.get_num_threads()
            torch.set_num_threads(threads or before)
            try:
                self.shared[key] = torch_reference(self.source, ids, mask, pos, self.source.info.num_layers,
                                                   exit_layer)
            finally:
                torch.set_num_threads(before)
        return self.shared[key]

    def reference64(self, model: str):
        """(logits, hidden state at the exit layer) of the validation batch computed in float64 with the same
        weights: what the float32 reference approximates. Each row runs alone on its own tokens (left padding
        dropped: a float64 run of a padded row turns it all NaN), so padding positions hold NaN. Computed once."""
        key = ("reference64", model)
        if key not in self.shared:
            ids, mask, pos = self.batch(model)
            exit_layer = self.exit_layer if model == "target" else None
            results = []
            with self.float64():
                for row in range(ids.shape[0]):
                    valid = mask[row].astype(bool)  # [S]; left padding, so the valid columns are one run
                    results.append(torch_reference(self.source, ids[row:row + 1, valid], mask[row:row + 1, valid],
                                                   pos[row:row + 1, valid], self.source.info.num_layers,
                                                   exit_layer))
            outputs = []
            for index in range(2):
                if results[0][index] is None:
                    outputs.append(None)
                    continue
                full = np.full(ids.shape + results[0][index].shape[2:], np.nan)  # [B, S, ...]
                for row, result in enumerate(results):
                    full[row, mask[row].astype(bool)] = result[index][0]
                outputs.append(full)
            self.shared[key] = tuple(outputs)
        return self.shared[key]

    @contextlib.contextmanager
    def float64(self):
        """The source model computing in float64 (a lazy source loads its weights as float64), float32 after."""
        weights = self.source.weights
        before = weights.dtype if weights is not None else None
        self.source.model.double()
        if weights is not None:
            weights.dtype = torch.float64
        try:
            yield
        finally:
            self.source.model.float()
            if weights is not None:
                weights.dtype = before

    def noise(self, model: str, output: int, columns: slice = slice(None)):
        """A callable: PyTorch's own float32 error in reference ``output`` (0 logits, 1 the exit hidden state) over
        the valid positions in ``columns``, as a distance between two float32 computations: the larger of max
        |reference at one thread - reference| and twice max |float64 reference - reference| (two float32 results
        with that error each can be twice as far apart; module docstring)."""
        def measure() -> float:
            mask = self.batch(model)[1][:, columns].astype(bool)
            if not mask.any():
                return 0.0
            one, default = self.reference(model, 1)[output], self.reference(model)[output]
            threads = float(np.max(np.abs(one[:, columns][mask] - default[:, columns][mask])))
            exact = self.reference64(model)[output][:, columns][mask]
            return max(threads, 2 * float(np.max(np.abs(exact - default[:, columns][mask]))))
        return measure


def require_all_passed(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.passed]
    if failed:
        detail = "; ".join(f"{c.name}: max |diff| {c.max_abs_diff:.3g} > {c.tolerance:.3g}" for c in failed)
        raise ValidationError("Exported graphs disagree with PyTorch", detail,
                              "report this with the model and options used; nothing was written")


def model_logits(folder: Path, model: str, info, exit_layer: int, kv_specs: dict,
                 batch: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A model's logits on its validation batch (or ``batch``: ids, mask, positions) from the files of ``folder``
    (target: prefix -> suffix), one session at a time; and the batch's mask. ``kv_specs``: role -> KVSpec."""
    ids, mask, pos = batch or sample_batch(info.vocab_size, SEEDS[model])
    roles = (names.PREFIX, names.SUFFIX) if model == "target" else (names.DRAFT,)
    first = ids
    for role in roles:
        runner = FileRunner(Path(folder) / names.graph_file(role), kv_specs[role])
        out = runner.run([Run("full", {runner.session.get_inputs()[0].name: first, names.ATTENTION_MASK: mask,
                                       names.POSITION_IDS: pos})])["full"]
        first = next(iter(out.values()))
        del runner
    return first, mask


TEXT_TOKENS = 128  # the real-text agreement reads the first tokens of the shipped text: seconds, not minutes


def text_batch(encode, info) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """One row of the shipped text's first tokens (ids, mask, positions), or None without a usable tokenizer.
    ``encode``: text -> token ids (a Hugging Face tokenizer's call, or an export folder's tokenizer)."""
    from mirrorsd.data import EVAL_TEXT

    if encode is None:
        return None
    ids = list(encode(EVAL_TEXT.read_text(encoding="utf-8")))[:min(TEXT_TOKENS, info.max_position_embeddings)]
    if len(ids) < 2 or max(ids) >= info.vocab_size:
        return None
    ids = np.asarray([ids], np.int64)
    return ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None]


def text_agreement(model: str, before: np.ndarray, after: np.ndarray) -> dict[str, float]:
    """Top-1 agreement of quantized with fp32 logits [1, S, vocab] on the shipped text."""
    return {f"{model}_quant_text_top1_agreement": float(np.mean(np.argmax(before, -1) == np.argmax(after, -1)))}


def quantization_effect(model: str, before: np.ndarray, after: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """How far quantized logits moved from fp32 ones (recorded, not a pass/fail: only non-finite output fails)."""
    sel = mask.astype(bool)
    if not np.isfinite(after[sel]).all():
        raise ValidationError("A quantized graph produced non-finite logits", "the quantizer broke the graph",
                              "export with --precision fp32 and report the model")
    agree = float(np.mean(np.argmax(before[sel], -1) == np.argmax(after[sel], -1)))
    return {f"{model}_quant_max_abs_diff": float(np.max(np.abs(before[sel] - after[sel]))),
            f"{model}_quant_top1_agreement": agree}
