"""AdamW with weight decay on matrices only, and a linear warm-up into a cosine decay."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

BETAS = (0.9, 0.95)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW whose decay applies to the matrices (projections, embedding), not the norm gains.

    Decaying a norm's gain pulls it towards zero for no benefit; matrices are where the
    parameters, and the overfitting, are.
    """
    parameters = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def lr_factor(step: int, *, warmup: int, steps: int, min_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (from 0), as a share of the peak.

    Linear from ``1 / (warmup + 1)`` to 1 over the first ``warmup`` steps, then half a cosine
    from 1 down to ``min_ratio`` at the last step.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, steps - 1 - warmup)  # 0 -> 1
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup: int, steps: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler stepped once per optimizer step; its state is just the step count."""
    factor = functools.partial(lr_factor, warmup=warmup, steps=steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
