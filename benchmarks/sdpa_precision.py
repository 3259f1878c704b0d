"""SDPA's forward and backward in bfloat16 against float32 on this CPU, at the model's shapes.

Under CPU autocast the model computes its attention in float32 (docs/design.md, 'Which
implementation auto runs'). This study shows why on the machine it runs on: the causal call
of the tiny preset's training step (16 rows of 128 tokens, 4 query heads and 2 key/value
heads of 32) timed in each dtype, alternating, in one process::

    python benchmarks/sdpa_precision.py [--rounds 7] [--calls 20]

It prints the median milliseconds of a forward and of a forward + backward per dtype and the
bfloat16 ÷ float32 ratio of each round (median, min–max). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from precision_step import alternate, ratio_fields, ratio_text  # this folder's: the script's own

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_SIZE = 16, 4, 2, 128, 32  # the tiny preset's step


def call(dtype: torch.dtype, backward: bool):
    """One causal SDPA call on fresh operands in ``dtype``, with its backward if asked."""
    generator = torch.Generator().manual_seed(0)

    def operand(heads: int) -> torch.Tensor:
        shape = (BATCH, heads, LENGTH, HEAD_SIZE)
        return torch.randn(shape, generator=generator).to(dtype).requires_grad_(backward)

    query, key, value = operand(HEADS), operand(KV_HEADS), operand(KV_HEADS)
    grad_out = torch.randn(BATCH, HEADS, LENGTH, HEAD_SIZE, generator=generator).to(dtype)

    def run() -> None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        if backward:
            out.backward(grad_out)

    return run


def milliseconds(run, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per dtype and round")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for backward in (False, True):
        runs = {dtype: call(dtype, backward) for dtype in (torch.float32, torch.bfloat16)}
        times, ratios = alternate(runs, args.rounds, lambda run: milliseconds(run, args.calls))
        label = "forward + backward" if backward else "forward"
        f32, bf16 = (statistics.median(times[d]) for d in runs)
        print(
            f"{label}: float32 {f32:.2f} ms, bfloat16 {bf16:.2f} ms; bfloat16 ÷ float32 "
            f"{ratio_text(ratio_fields(ratios), args.rounds)}"
        )


if __name__ == "__main__":
    main()
