"""Low-rank adapters on the linear layers of the streamed (top) layers, merged into plain weights at the end.

    y = W x + (alpha / r) * B (A x)        A [r, in] small random, B [out, r] zeros: training starts at the base
    merged: W' = W + (alpha / r) * B A     (the exported draft is an ordinary model again)
"""
from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale  # [..., out]

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        self.base.weight += self.scale * (self.lora_b @ self.lora_a)
        return self.base


def add_adapters(modules, rank: int, alpha: float) -> int:
    """Wrap every nn.Linear inside ``modules`` (e.g. the streamed decoder layers); returns how many."""
    count = 0
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank, alpha))
                    count += 1
    return count


def merge_adapters(root: nn.Module) -> int:
    """Replace every LoRALinear under ``root`` with its merged plain Linear; returns how many."""
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
                count += 1
    return count
