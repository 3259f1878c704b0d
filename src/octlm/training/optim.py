"""The optimizers (AdamW, or Muon for the blocks' matrices with AdamW for the rest), and a
linear warm-up into a cosine decay."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

BETAS = (0.9, 0.95)
OPTIMIZERS = ("adamw", "muon")


class Joint(torch.optim.Optimizer):
    """Optimizers of disjoint parameters acting as one: stepped, zeroed and scheduled together.

    ``param_groups`` and ``state`` are the parts' own, read through, so one scheduler, one
    gradient scaler and one state dict serve them all. The state dict is the standard one,
    numbering the parameters across the parts in order, so ``torch.distributed.checkpoint``
    keys it by parameter name as it does any optimizer's.
    """

    def __init__(self, parts: Sequence[torch.optim.Optimizer]):
        # Not Optimizer.__init__, which would build param groups of its own: these are the parts'.
        self.parts = tuple(parts)
        self.defaults = {}

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> collections.ChainMap:  # type: ignore[override]
        return collections.ChainMap(*(part.state for part in self.parts))

    def step(self, closure=None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Joint.step takes no closure: its parts would each call it")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:  # type: ignore[override]
        joined = {"state": {}, "param_groups": []}
        offset = 0
        for part in self.parts:
            own = part.state_dict()
            joined["state"] |= {offset + index: value for index, value in own["state"].items()}
            joined["param_groups"] += [
                {**group, "params": [offset + index for index in group["params"]]}
                for group in own["param_groups"]
            ]
            offset += sum(len(group["params"]) for group in own["param_groups"])
        return joined

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} parameter groups where this optimizer has "
                f"{len(self.param_groups)}: it was saved by another optimizer"
            )
        for part in self.parts:
            own, groups = groups[: len(part.param_groups)], groups[len(part.param_groups) :]
            keys = {key for group in own for key in group["params"]}
            state = {key: value for key, value in state_dict["state"].items() if key in keys}
            part.load_state_dict({"state": state, "param_groups": own})


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    *,
    optimizer: str = "adamw",
    muon_lr: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW over every parameter, or with ``optimizer="muon"`` Muon over the matrices of
    ``model.blocks`` (at ``muon_lr``) and AdamW over the rest (embedding, head, norms).

    Weight decay applies to matrices, not to norm gains: decaying a gain pulls it towards zero
    for no benefit; matrices are where the parameters, and the overfitting, are. Muon's step
    is scaled to AdamW's update size (``adjust_lr_fn="match_rms_adamw"``), so its rate and
    decay are on AdamW's scale.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    parameters = [p for p in model.parameters() if p.requires_grad]
    matrices = set()
    if optimizer == "muon":
        matrices = {id(p) for p in model.blocks.parameters() if p.requires_grad and p.dim() == 2}
    rest = [p for p in parameters if id(p) not in matrices]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=BETAS)
    if not matrices:
        return adamw
    muon = torch.optim.Muon(
        [p for p in parameters if id(p) in matrices],
        lr=lr if muon_lr is None else muon_lr,
        weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return Joint([adamw, muon])


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
