"""The exit adapter and its training loop: PyTorch only, on precomputed features (no ONNX, no sessions).

    x      [N, H]  the exit head's LM-head input at the exit layer: final_norm(h(L)) (features.py reads it from the
                   export's own exit_head graph, so whatever norm the model has is the one the adapter sees)
    x'     = x + (x @ down) @ up          down [H, r], up [r, H]; up starts at zero: the untrained adapter is the
                                          identity, so "untrained" is exactly the shipped exit head
    logits = x' @ W + b                   W [H, V], b [V]: the target's own LM head, frozen (read from the graph)
    loss   = cross-entropy of logits against the target's final greedy token at that position

Only ``down`` and ``up`` train; the target's graphs and outputs are untouched (the exit only ranks branches).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

EVAL_CHUNK = 512  # rows per scoring pass: bounds the [rows, vocab] logits of a large vocabulary


class ExitAdapter(nn.Module):
    """x -> x + (x @ down) @ up (residual low-rank map on the LM head's input)."""

    def __init__(self, hidden: int, rank: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.down = nn.Parameter(torch.randn(hidden, rank, generator=gen) / math.sqrt(hidden))
        self.up = nn.Parameter(torch.zeros(rank, hidden))

    @property
    def rank(self) -> int:
        return self.down.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (x @ self.down) @ self.up  # [..., H]


@dataclass(frozen=True)
class FitOptions:
    rank: int = 64
    epochs: int = 6
    batch: int = 256  # rows per optimizer step
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0
    max_minutes: float | None = None  # stop after this much training time (the data pass is not counted)


@dataclass(frozen=True)
class Scores:
    """Held-out quality of an exit: top-k hit rates on the target's final token, and the mean cross-entropy."""

    rows: int
    loss: float
    hit: dict[int, float]  # k -> share of rows whose target token is in the exit's top-k


@dataclass(frozen=True)
class FitResult:
    adapter: ExitAdapter
    before: Scores
    after: Scores
    steps: int
    seconds: float
    history: list[float]  # held-out loss after each epoch


def head_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = x @ weight  # [N, V]
    return logits if bias is None else logits + bias


@torch.no_grad()
def score(adapter: ExitAdapter | None, x: np.ndarray, labels: np.ndarray, weight: torch.Tensor,
          bias: torch.Tensor | None, ks: tuple[int, ...] = (1, 4, 8)) -> Scores:
    """Hit rates and loss of ``adapter`` (None: the untrained exit) on features ``x`` [N, H], labels [N]."""
    hits, loss = {k: 0 for k in ks}, 0.0
    for start in range(0, len(x), EVAL_CHUNK):
        xs = torch.from_numpy(x[start:start + EVAL_CHUNK])
        ys = torch.from_numpy(labels[start:start + EVAL_CHUNK])
        logits = head_logits(xs if adapter is None else adapter(xs), weight, bias)
        loss += float(nn.functional.cross_entropy(logits, ys, reduction="sum"))
        top = torch.topk(logits, max(ks), dim=-1).indices  # [n, kmax]
        found = top == ys[:, None]
        for k in ks:
            hits[k] += int(found[:, :k].any(-1).sum())
    n = max(len(x), 1)
    return Scores(len(x), loss / n, {k: hits[k] / n for k in ks})


def fit(train_x: np.ndarray, train_y: np.ndarray, eval_x: np.ndarray, eval_y: np.ndarray, weight: torch.Tensor,
        bias: torch.Tensor | None, options: FitOptions = FitOptions(), progress=lambda text: None) -> FitResult:
    """Train an adapter of ``options.rank`` on (train_x [N, H], train_y [N]); score before and after on eval."""
    torch.manual_seed(options.seed)
    adapter = ExitAdapter(train_x.shape[1], options.rank, options.seed)
    before = score(None, eval_x, eval_y, weight, bias)
    progress(f"untrained exit: held-out top-4 {before.hit[4]:.3f}, loss {before.loss:.3f}")
    opt = torch.optim.AdamW(adapter.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    total = options.epochs * max(1, math.ceil(len(train_x) / options.batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=options.lr, total_steps=max(total, 1), pct_start=0.1)
    xs, ys = torch.from_numpy(train_x), torch.from_numpy(train_y)
    gen = torch.Generator().manual_seed(options.seed)
    started, steps, history = time.perf_counter(), 0, []
    out_of_time = False
    for epoch in range(options.epochs):
        order = torch.randperm(len(xs), generator=gen)
        for start in range(0, len(xs), options.batch):
            rows = order[start:start + options.batch]
            loss = nn.functional.cross_entropy(head_logits(adapter(xs[rows]), weight, bias), ys[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
            if options.max_minutes is not None and time.perf_counter() - started > 60 * options.max_minutes:
                out_of_time = True
                break
        history.append(score(adapter, eval_x, eval_y, weight, bias, ks=(4,)).loss)
        progress(f"epoch {epoch + 1}: held-out loss {history[-1]:.3f}")
        if out_of_time:
            break
    after = score(adapter, eval_x, eval_y, weight, bias)
    return FitResult(adapter.eval(), before, after, steps, time.perf_counter() - started, history)
