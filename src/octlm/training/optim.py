"""The optimizers (AdamW, or Muon for the blocks' matrices with AdamW for the rest), and a
linear warm-up into a cosine decay over the run's steps or over its time budget."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

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


def orthogonalise_all(
    updates: Sequence[Tensor],
    coefficients: tuple,
    steps: int,
    eps: float,
    precision: torch.dtype = torch.float32,
) -> list[Tensor]:
    """Each of ``updates (A, B)`` made nearly orthogonal by ``steps`` quintic Newton-Schulz
    iterations in ``precision`` (torch.optim.Muon's iteration and coefficients), so that its
    singular values end near 1. Those of one shape (up to a transpose) are stacked and iterated
    together: a block's matrices come in a few shapes, and one batched product per shape costs
    far less than one per matrix where the matrices are small."""
    a, b, c = coefficients
    oriented = [update.T if update.size(0) > update.size(1) else update for update in updates]
    together = collections.defaultdict(list)  # (short, long) shape, dtype, device -> indices
    for index, update in enumerate(oriented):
        together[update.shape, update.dtype, update.device].append(index)
    results = list(updates)
    for indices in together.values():
        x = torch.stack([oriented[index] for index in indices]).to(precision)  # (N, short, long)
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # spectral norms at most 1
        for _ in range(steps):
            gram = x @ x.mT  # (N, short, short)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for index, orthogonal in zip(indices, x, strict=True):
            tall = updates[index].size(0) > updates[index].size(1)
            results[index] = (orthogonal.T if tall else orthogonal).to(updates[index].dtype)
    return results


# torch.optim.Muon came with torch 2.9; with an older torch, --optimizer muon is refused.
_MUON = getattr(torch.optim, "Muon", torch.optim.Optimizer)
# The best recipe measured: Muon where torch has it.
DEFAULT_OPTIMIZER = "adamw" if _MUON is torch.optim.Optimizer else "muon"


class Muon(_MUON):
    """``torch.optim.Muon`` orthogonalising in ``precision``, with the update scaled to AdamW's
    size.

    torch's Muon always casts each update to bfloat16 for its Newton-Schulz iteration, which
    pays where the hardware has bfloat16 units; a CPU without them runs those products several
    times slower than in float32, and Muon's step then costs more than the model's forward and
    backward. So the run picks the precision as it picks its dtype (bfloat16 where the run
    computes in bfloat16). The momentum, decay, iteration and state (``momentum_buffer``) are
    torch's; the step size is ``0.2 * sqrt(max(A, B))`` times the rate (torch's
    ``adjust_lr_fn="match_rms_adamw"``), so the rate and the decay are on AdamW's scale.
    """

    def __init__(
        self, params, lr: float, weight_decay: float, precision: torch.dtype = torch.float32
    ):
        super().__init__(params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.precision = precision

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = group["momentum"]
            params = [param for param in group["params"] if param.grad is not None]
            updates = []
            for param in params:
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                updates.append(param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
            orthogonal = orthogonalise_all(
                updates,
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
                self.precision,
            )
            for param, update in zip(params, orthogonal, strict=True):
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(param.shape)))
        return loss


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    *,
    optimizer: str = "adamw",
    muon_lr: float | None = None,
    precision: torch.dtype = torch.float32,
) -> torch.optim.Optimizer:
    """AdamW over every parameter, or with ``optimizer="muon"`` :class:`Muon` over the matrices
    of ``model.blocks`` (at ``muon_lr``, orthogonalising in ``precision``) and AdamW over the
    rest (embedding, head, norms).

    Weight decay applies to matrices, not to norm gains: decaying a gain pulls it towards zero
    for no benefit; matrices are where the parameters, and the overfitting, are.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "muon" and _MUON is torch.optim.Optimizer:
        raise ValueError(
            f"optimizer 'muon' needs torch.optim.Muon (torch 2.9 or later); this is torch "
            f"{torch.__version__}: upgrade torch or use optimizer 'adamw'"
        )
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
    muon = Muon(
        [p for p in parameters if id(p) in matrices],
        lr=lr if muon_lr is None else muon_lr,
        weight_decay=weight_decay,
        precision=precision,
    )
    return Joint([adamw, muon])


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
