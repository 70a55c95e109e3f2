"""How good a model's next-token predictions are on real text: perplexity, and top-1 agreement with a reference.

    text  --tokenize-->  ids [N]  --windows of W-->  [w0 | w1 | ...]   (each window starts with an empty cache)
    each window: logits [W, vocab] -> NLL of ids[1:], argmax at [0, W-1)  (the first token is context only)
    perplexity = exp(mean NLL over every scored token);  agreement = share of scored positions whose argmax
    equals the reference's

The text defaults to ``mirrorsd/data/eval_text.txt``, written for this project (docs/quality.md says what it holds).
Every model is scored in turn and closed before the next one opens, so memory stays at one model. Scorers live in
apps/quality_models.py (export folders, Hugging Face folders, OpenVINO IR folders); this module holds the arithmetic
and the loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mirrorsd.data import EVAL_TEXT
from mirrorsd.errors import GenerationInputError

DEFAULT_TEXT = EVAL_TEXT
MIN_WINDOW = 2  # a window scores its tokens after the first: fewer than two tokens scores nothing


@dataclass(frozen=True)
class EvalOptions:
    """What ``mirrorsd eval`` measures. ``models``: folders to score (export, Hugging Face or OpenVINO IR);
    ``reference``: the folder whose argmax the others are compared with (None: no agreement column)."""

    models: tuple[Path, ...]
    reference: Path | None = None
    role: str = "target"  # which model of an export folder: target or draft
    text: Path | None = None  # None: the shipped text
    window: int = 256  # tokens per window, each scored from an empty cache
    max_tokens: int | None = None  # score only the first N tokens of the text
    score_from: int = 0  # in each window, score the predictions from this position on (llama.cpp's perplexity
    # tool scores the second half of each window: --window 256 --score-from 128 reproduces its -c 256)
    kernels: str = "auto"  # an export's MatMulNBits kernel on ONNX Runtime CPU: auto | mirrorsd | ort


@dataclass
class Score:
    """One model's predictions on the text: the negative log-likelihood and argmax at every scored position."""

    label: str
    kind: str  # "export", "hf", "openvino"
    size_bytes: int
    nll: np.ndarray  # [T] float64
    top1: np.ndarray  # [T] int64
    seconds: float = 0.0
    agreement: float | None = None  # share of positions where top1 equals the reference's

    @property
    def tokens(self) -> int:
        return int(self.nll.size)

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


@dataclass
class EvalResult:
    text: str  # the text file's path, or "shipped"
    tokens: int  # tokens of the text after --max-tokens
    window: int
    reference: Score | None
    rows: list[Score] = field(default_factory=list)
    score_from: int = 0


def read_text(path: Path | None) -> str:
    """The evaluation text: ``path``, or the shipped file. Empty or unreadable text is a clear error."""
    path = DEFAULT_TEXT if path is None else Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GenerationInputError(f"The text file {path} does not exist", "eval scores a model on a text file",
                                   "pass an existing UTF-8 file with --text, or leave --text out for the shipped one"
                                   ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationInputError(f"Could not read the text file {path}", f"{type(exc).__name__}: {exc}",
                                   "pass a readable UTF-8 text file with --text") from None
    if not text.strip():
        raise GenerationInputError(f"The text file {path} is empty", "there is nothing to predict",
                                   "pass a file with some text in it")
    return text


def check_options(options: EvalOptions) -> None:
    if options.window < MIN_WINDOW:
        raise GenerationInputError(f"--window {options.window} is too small",
                                   f"a window scores its tokens after the first, so it needs {MIN_WINDOW} or more",
                                   "pass --window 256, for example")
    if options.max_tokens is not None and options.max_tokens < MIN_WINDOW:
        raise GenerationInputError(f"--max-tokens {options.max_tokens} is too small",
                                   f"scoring needs {MIN_WINDOW} tokens or more", "pass --max-tokens 512, for example")
    if not 0 <= options.score_from < options.window - 1:
        raise GenerationInputError(f"--score-from {options.score_from} is out of range",
                                   f"a window of {options.window} tokens scores positions 0..{options.window - 2}",
                                   f"pass --score-from below {options.window - 1}, e.g. {options.window // 2}")
    if not options.models:
        raise GenerationInputError("No model to evaluate", "eval needs at least one --model",
                                   "pass --model EXPORT_FOLDER")


def windows(ids: list[int], size: int) -> list[np.ndarray]:
    """Consecutive windows of ``size`` tokens; a last window shorter than two tokens is dropped."""
    out = [np.asarray(ids[i:i + size], np.int64) for i in range(0, len(ids), size)]
    return [w for w in out if w.size >= MIN_WINDOW]


def score_window(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits [S, vocab] of window ``ids`` [S] -> (NLL of ids[1:] [S-1], argmax at positions [0, S-1))."""
    head = logits[:-1].astype(np.float64)  # [S-1, vocab]: position i predicts ids[i + 1]
    peak = head.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(head - peak).sum(axis=-1)) + peak[:, 0]  # [S-1]
    picked = head[np.arange(head.shape[0]), ids[1:]]
    return log_norm - picked, np.argmax(head, axis=-1).astype(np.int64)


def agreement(row: Score, reference: Score) -> float:
    if row.top1.shape != reference.top1.shape:
        raise GenerationInputError(f"{row.label} and the reference scored different positions",
                                   f"{row.top1.size} vs {reference.top1.size} tokens",
                                   "evaluate models that share a tokenizer")
    return float(np.mean(row.top1 == reference.top1))


def evaluate(options: EvalOptions, progress: bool = True) -> EvalResult:
    """Score every model of ``options`` (and the reference first) on the text; each model is closed after."""
    import time

    from tqdm import tqdm

    from mirrorsd.apps.quality_models import ROLES, open_scorer, scorer_kind

    check_options(options)
    text = read_text(options.text)
    folders = ([options.reference] if options.reference else []) + list(options.models)
    for folder in folders:
        scorer_kind(folder)
    if options.role not in ROLES:
        raise GenerationInputError(f"--role {options.role!r} is not a model of an export",
                                   f"choose {' or '.join(ROLES)}", "pass --role target or --role draft")
    ids: list[int] | None = None
    scores = []
    for folder in folders:
        with open_scorer(folder, options.role, options.kernels) as scorer:
            mine = scorer.tokenize(text)[:options.max_tokens]
            if ids is None:
                ids = mine
                if len(windows(ids, options.window)) == 0:
                    raise GenerationInputError("The text is too short", f"it is {len(ids)} token(s) long",
                                               "pass a longer --text")
            elif mine != ids:
                raise GenerationInputError(f"{folder} tokenizes the text differently from {scores[0].label}",
                                           "perplexity and agreement compare the same token positions",
                                           "compare models that share a tokenizer")
            start = time.perf_counter()
            parts = [score_window(scorer.logits(w), w)
                     for w in tqdm(windows(ids, options.window), desc=scorer.label[-40:], unit="window",
                                   disable=not progress)]
            parts = [(nll[options.score_from:], top1[options.score_from:]) for nll, top1 in parts]
            scores.append(Score(scorer.label, scorer.kind, scorer.size_bytes,
                                np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                                time.perf_counter() - start))
    reference = scores.pop(0) if options.reference else None
    for row in scores:
        row.agreement = agreement(row, reference) if reference else None
    return EvalResult(str(options.text or "shipped"), len(ids), options.window, reference, scores,
                      options.score_from)


def table(result: EvalResult) -> str:
    """A small markdown table: one row per model, the reference first."""
    lines = [f"text: {result.text}, {result.tokens} tokens in windows of {result.window}"
             + (f", scored from position {result.score_from}" if result.score_from else ""),
             "", "| model | kind | perplexity | top-1 agreement | size (MB) | seconds |", "|---|---|---|---|---|---|"]
    rows = ([result.reference] if result.reference else []) + result.rows
    for r in rows:
        agree = "reference" if r is result.reference else ("-" if r.agreement is None else f"{r.agreement:.4f}")
        lines.append(f"| {r.label} | {r.kind} | {r.perplexity:.4f} | {agree} | {r.size_bytes / 1e6:.1f} | "
                     f"{r.seconds:.2f} |")
    return "\n".join(lines) + "\n"


def to_dict(result: EvalResult) -> dict:
    def row(r: Score) -> dict:
        return {"model": r.label, "kind": r.kind, "perplexity": r.perplexity, "top1_agreement": r.agreement,
                "tokens": r.tokens, "size_bytes": r.size_bytes, "seconds": r.seconds}

    return {"text": result.text, "tokens": result.tokens, "window": result.window, "score_from": result.score_from,
            "reference": row(result.reference) if result.reference else None, "rows": [row(r) for r in result.rows]}
