"""The attention shape a verification record is about, its inputs, and the record itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from octlm.attention import implementation
from octlm.equality import Verdict

QKV = ("query", "key", "value")
JUDGED = ("error", "base_error", "tolerance", "max_abs_diff")


@dataclass(frozen=True)
class Case:
    """The attention shape a record is about: the fields of docs/design.md, 'Records', and
    the inputs' sizes."""

    length: int  # keys (and queries, unless q_len is given)
    kv_heads: int = 8
    heads: int = 8
    head_size: int = 32
    batch: int = 1
    causal: bool = True
    window: int = 0
    block: int | tuple[int, int] | None = None
    q_len: int | None = None
    strided: bool = False  # inputs laid out (B, L, heads, D) and transposed, as a model's are

    @property
    def queries(self) -> int:
        return self.length if self.q_len is None else self.q_len

    def options(self) -> dict:
        return {"causal": self.causal, "window": self.window}


def outcome(
    check: str, left: str, right: str, case: Case, dtype: torch.dtype, passed: bool, **figures
) -> dict:
    """One verification record (docs/design.md, 'Records'), without the context fields; ``figures``
    are the check's own (a check that is not judged by the equality rule leaves
    :data:`JUDGED` empty and says what it counted instead)."""
    return {
        "check": check,
        "left": left,
        "right": right,
        "dtype": str(dtype).removeprefix("torch."),
        "length": case.length,
        "q_len": case.queries,
        "block": case.block,
        "kv_heads": case.kv_heads,
        "head_size": case.head_size,
        "causal": case.causal,
        "window": case.window,
        **dict.fromkeys(JUDGED),
        "passed": passed,
        **figures,
    }


def record(
    check: str,
    left: str,
    right: str,
    case: Case,
    dtype: torch.dtype,
    verdict: Verdict,
    diff: float,
    **extra,
) -> dict:
    """The record of a check judged by the equality rule (docs/design.md, 'When are two results
    equal'): its errors, tolerance and the pairwise difference ``diff``."""
    return outcome(
        check,
        left,
        right,
        case,
        dtype,
        verdict.passed,
        error=verdict.error,
        base_error=verdict.base_error,
        tolerance=verdict.tolerance,
        max_abs_diff=diff,
        **extra,
    )


def inputs(case: Case, dtype: torch.dtype, device: str, seed: int = 0) -> list[Tensor]:
    """Query, key, value ``(B, heads, L, D)`` drawn in float64 then rounded to ``dtype``: every
    dtype sees the same numbers, and ``x.double()`` is the reference's input. They are drawn
    ``(B, L, heads, D)`` and transposed; ``case.strided`` keeps that layout, as in a model."""
    generator = torch.Generator().manual_seed(seed)
    query = (case.batch, case.queries, case.heads, case.head_size)
    key = (case.batch, case.length, case.kv_heads, case.head_size)
    drawn = [torch.randn(s, generator=generator, dtype=torch.float64) for s in (query, key, key)]
    inputs = [x.to(device, dtype).transpose(1, 2) for x in drawn]
    return inputs if case.strided else [x.contiguous() for x in inputs]


def attend(name: str, query: Tensor, key: Tensor, value: Tensor, case: Case) -> Tensor:
    impl = implementation(name)
    tuning = {"block": case.block, "kernel": "pytorch"} if "block" in impl.tuning else {}
    return impl.function(query, key, value, **case.options(), **tuning)
