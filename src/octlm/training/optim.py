"""AdamW with weight decay on matrices only, and a linear warm-up into a cosine decay over the
run's steps or over its time budget."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

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
        return _warm_up(step, warmup)
    return _cosine(_step_progress(step, warmup, steps), min_ratio)


def budget_factor(
    step: int,
    *,
    warmup: int,
    steps: int | None,
    min_ratio: float,
    budget: float,
    elapsed: Callable[[], float],
) -> float:
    """:func:`lr_factor` with the cosine laid over time: at the share of ``budget`` seconds
    that ``elapsed()`` has used, or at the steps' share where ``steps`` is given and further
    along, so that the rate reaches ``min_ratio`` wherever the run ends. The warm-up stays
    counted in steps: it is there to let the first updates settle, however long they take."""
    if step < warmup:
        return _warm_up(step, warmup)
    progress = elapsed() / budget
    if steps is not None:
        progress = max(progress, _step_progress(step, warmup, steps))
    return _cosine(progress, min_ratio)


def _warm_up(step: int, warmup: int) -> float:
    """Linear from ``1 / (warmup + 1)`` at step 0 towards 1."""
    return (step + 1) / (warmup + 1)


def _step_progress(step: int, warmup: int, steps: int) -> float:
    """How far past the warm-up step ``step`` is: 0 at its end, 1 at the last step."""
    return (step - warmup) / max(1, steps - 1 - warmup)


def _cosine(progress: float, min_ratio: float) -> float:
    """Half a cosine from 1 at ``progress`` 0 down to ``min_ratio`` at 1 (and after)."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup: int,
    steps: int | None,
    min_ratio: float,
    budget: float | None = None,
    elapsed: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler stepped once per optimizer step; its state is just the step count. With a
    ``budget`` (seconds) it follows ``elapsed()``, the training seconds so far, read at each
    step (:func:`budget_factor`)."""
    options = dict(warmup=warmup, steps=steps, min_ratio=min_ratio)
    if budget is None:
        factor = functools.partial(lr_factor, **options)
    else:
        factor = functools.partial(budget_factor, **options, budget=budget, elapsed=elapsed)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
