"""When two attention results count as equal (docs/design.md, 'When are two results equal').

A result in some dtype is judged against a float64 "golden" reference, relative to the error
that the plain method (naive attention) makes in that same dtype, as PyTorch's and
FlashAttention's own tests do::

    pass  iff  max|tested - ref| <= factor * max|base - ref| + atol

with ``factor`` 2 for outputs and 3 for gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.bfloat16: 1e-3,
    torch.float16: 1e-3,
}
OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


@dataclass(frozen=True)
class Verdict:
    """The two errors, the tolerance they imply, and whether the tested result passes."""

    error: float
    base_error: float
    tolerance: float
    passed: bool

    def __str__(self) -> str:
        mark = "ok" if self.passed else "FAIL"
        return (
            f"{mark}: error {self.error:.3g} vs tolerance {self.tolerance:.3g} "
            f"(plain method's error {self.base_error:.3g})"
        )


def max_abs_diff(left: Tensor, right: Tensor) -> float:
    """Largest absolute difference, computed in float64.

    Places where both sides hold the same value (NaN and infinities included) differ by 0; a
    NaN or infinity on one side only differs by inf. So NaN where the reference has NaN is
    right, and NaN anywhere else is as wrong as a result can be.
    """
    if left.shape != right.shape:
        raise ValueError(f"cannot compare shapes {tuple(left.shape)} and {tuple(right.shape)}")
    left, right = left.detach().double(), right.detach().double()
    same = (left == right) | (left.isnan() & right.isnan())
    diff = torch.where(same, 0.0, (left - right).abs()).nan_to_num(nan=float("inf"))
    return diff.max().item() if diff.numel() else 0.0


def judge(
    tested: Tensor, base: Tensor, reference: Tensor, *, factor: float = OUTPUT_FACTOR
) -> Verdict:
    """Apply the rule of docs/design.md, 'When are two results equal'; ``tested`` and ``base`` share
    a dtype, ``reference`` is fp64.

    A plain method that is itself off by an infinite error (NaN where the reference has none)
    sets no tolerance: the verdict fails rather than accept anything.
    """
    if tested.dtype not in ATOL:
        raise TypeError(f"no tolerance defined for dtype {tested.dtype}")
    error = max_abs_diff(tested, reference)
    base_error = max_abs_diff(base, reference)
    tolerance = factor * base_error + ATOL[tested.dtype]
    return Verdict(error, base_error, tolerance, math.isfinite(tolerance) and error <= tolerance)
