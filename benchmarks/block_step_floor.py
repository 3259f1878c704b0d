"""How close can PyTorch operations get to SDPA's fused FLASH kernel? The floor, measured.

One thread, batch 1, 8 heads of 32, causal, float32 (``--length``, 8,192 by default). Per
round, in an order that rotates from round to round, one forward of each of:

- ``flash``: ``F.scaled_dot_product_attention(..., is_causal=True)``, SDPA's C++ FLASH kernel;
- ``tiled``: ``octlm.attention.tiled_attention``;
- ``bare``: the fewest PyTorch operations a blocked online softmax can issue per tile (score
  matmul, exp2 in place, row sum, output matmul; the diagonal tile adds a causal bias; each row
  block takes its shift from its first tile). No masks beyond causal, no NaN or overflow
  handling, no GQA: a lower bound for any implementation built from PyTorch operations;
- ``compiled``: ``bare`` with the per-tile ``exp2 + row sum + output matmul`` compiled by
  ``torch.compile`` (inductor fuses the exponential and the sum into one pass over the tile),
  when a C++ compiler is there (``--no-compile`` skips it).

Prints each per-round time, the median ratio to FLASH with its range, and the machine's fp32
matmul rate (a 4096² ``torch.mm``) for scale. Then what one tile's operations cost apiece
(best of 200 calls), set against FLASH's time per tile of work: where the difference goes.
``--tile`` sets the tile (rows = keys), to see whether a tile that fits in cache helps. Run it
alone on the machine::

    OMP_NUM_THREADS=1 python benchmarks/block_step_floor.py --rounds 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from octlm.attention import tiled_attention

HEADS, HEAD_SIZE = 8, 32


def bare_forward(query, key, value, step=None, size=256):
    """Causal attention of ``(H, T, D)`` tensors, tile by tile (``size`` rows and keys, ``T`` a
    multiple of it), in as few operations as can be."""
    heads, length, head_size = query.shape
    query = query * (head_size**-0.5 * math.log2(math.e))  # scores in base-2 units
    out = torch.empty_like(query)
    tile = query.new_empty(heads, size, size)
    rows, columns = torch.arange(size)[:, None], torch.arange(size)[None]
    diagonal = torch.zeros(size, size).masked_fill_(columns > rows, float("-inf"))
    for start in range(0, length, size):
        q_block = query[:, start : start + size]  # (H, R, D)
        acc = total = shift = None
        for first in range(0, start + size, size):
            keys = slice(first, first + size)
            scores = torch.bmm(q_block, key[:, keys].transpose(1, 2), out=tile)  # (H, R, C)
            if first == start:
                scores.add_(diagonal)
            if shift is None:
                shift = scores.amax(dim=-1, keepdim=True)  # (H, R, 1)
            if step is not None and acc is not None:
                acc, total = step(scores, shift, value[:, keys], acc, total)
                continue
            weights = scores.sub_(shift).exp2_()  # (H, R, C)
            row_sum = weights.sum(dim=-1, keepdim=True)  # (H, R, 1)
            if acc is None:
                acc, total = torch.bmm(weights, value[:, keys]), row_sum
            else:
                acc.baddbmm_(weights, value[:, keys])
                total += row_sum
        out[:, start : start + size] = acc / total
    return out


def fused_step(scores, shift, value, acc, total):
    """One tile's exponential, row sum and output update: what inductor may fuse."""
    weights = torch.exp2(scores - shift)  # (H, R, C)
    return torch.baddbmm(acc, weights, value), total + weights.sum(dim=-1, keepdim=True)


def tile_costs(size: int, total: float, tiles: int) -> None:
    """Print what each operation of one ``(H, size, size)`` tile costs, against FLASH's time
    per tile of the same work (``total`` seconds over ``tiles`` tiles)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(HEADS, size, HEAD_SIZE) for _ in range(3))
    scores = torch.empty(HEADS, size, size)
    weights = torch.rand(HEADS, size, size) * -20  # typical scores below the shift, base 2
    acc = torch.zeros(HEADS, size, HEAD_SIZE)
    row_sum = torch.empty(HEADS, size, 1)
    copy = min(seconds(lambda: scores.copy_(weights)) for _ in range(200))
    costs = {
        "score matmul (bmm)": min(
            seconds(lambda: torch.bmm(query, key.transpose(1, 2), out=scores)) for _ in range(200)
        ),
        "exp2 in place": min(seconds(lambda: scores.copy_(weights).exp2_()) for _ in range(200))
        - copy,
        "row sum": min(
            seconds(lambda: torch.sum(weights, -1, keepdim=True, out=row_sum)) for _ in range(200)
        ),
        "output matmul (baddbmm)": min(
            seconds(lambda: acc.baddbmm_(weights, value)) for _ in range(200)
        ),
    }
    whole = sum(costs.values())
    print(f"\none {HEADS} x {size} x {size} tile, best of 200 calls each:")
    for name, cost in costs.items():
        print(f"  {name:24s} {cost * 1e6:7.1f} µs  {cost / whole:4.0%}")
    print(f"  {'sum of the four':24s} {whole * 1e6:7.1f} µs")
    print(f"  FLASH's median time per tile of work ({tiles} tiles): {total / tiles * 1e6:.1f} µs")


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tile", type=int, default=256, help="rows and keys per tile")
    args = parser.parse_args()
    if args.length % args.tile:
        parser.error(f"--length must be a multiple of --tile, got {args.length} and {args.tile}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, HEADS, args.length, HEAD_SIZE) for _ in range(3))
    flat = [x[0] for x in (query, key, value)]  # (H, T, D)
    calls = {
        "flash": lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True),
        "tiled": lambda: tiled_attention(query, key, value, causal=True),
        "bare": lambda: bare_forward(*flat, size=args.tile),
    }
    reference = calls["flash"]()[0]
    if not args.no_compile:
        step = torch.compile(fused_step, dynamic=False, fullgraph=True)
        calls["compiled"] = lambda: bare_forward(*flat, step=step, size=args.tile)
    for name, call in calls.items():  # warm-up, compile, and a check that each is attention
        error = (call()[0] if name != "bare" and name != "compiled" else call()) - reference
        print(f"{name:9s} max |difference| from flash {error.abs().max().item():.1e}", flush=True)
    a = torch.randn(4096, 4096)
    peak = 2 * 4096**3 / min(seconds(lambda: torch.mm(a, a)) for _ in range(3)) / 1e9
    names, times = list(calls), {name: [] for name in calls}
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            times[name].append(seconds(calls[name]))
        line = "  ".join(f"{name} {times[name][-1]:.3f} s" for name in names)
        print(f"round {round_ + 1}: {line}", flush=True)
    flops = 4 * HEADS * HEAD_SIZE * args.length * (args.length + 1) / 2  # two matmuls, causal
    print(f"\nfp32 matmul, one thread: {peak:.0f} GFLOP/s (4096² torch.mm, best of 3)")
    for name in names:
        ratios = [t / f for t, f in zip(times[name], times["flash"], strict=True)]
        best = min(times[name])
        print(
            f"{name:9s} median {statistics.median(times[name]):.3f} s; ÷ flash per round: median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}); "
            f"{flops / best / 1e9 / peak:.0%} of the matmul rate at its fastest"
        )
    tiles = args.length * (args.length + 1) / 2 / args.tile**2  # the causal work, in tiles
    tile_costs(args.tile, statistics.median(times["flash"]), round(tiles))


if __name__ == "__main__":
    main()
