"""What a pause between two multi-threaded PyTorch operations costs on this machine.

Decoding one token runs a handful of multi-threaded operations per layer (score matmul,
maximum, exponential, sum, value matmul), with a little Python between them. This probe runs
that sequence on SDPA's decode shape (8 heads of 32, one query against ``--keys`` keys) and
waits a fixed time between the operations, busy in Python as the library would be, then
prints the median time of the two matmuls. If the matmuls slow down as the pause grows, the
machine charges for waking or rescheduling the idle intra-op thread (a virtual machine whose
host deschedules spinning vCPUs does), and a sequence of separate operations loses to one
fused kernel by that much per operation::

    python benchmarks/op_gap_probe.py --keys 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HEADS, HEAD_SIZE = 8, 32


def pause(microseconds: float) -> None:
    """Busy Python for ``microseconds``, as the library's own code between operations is."""
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--pauses", type=float, nargs="+", default=[0, 10, 20, 50, 100, 0])
    args = parser.parse_args()
    query = torch.randn(HEADS, 1, HEAD_SIZE)
    key, value = (torch.randn(HEADS, args.keys, HEAD_SIZE) for _ in range(2))
    print(f"{torch.get_num_threads()} intra-op threads, {args.keys} keys, {args.calls} calls each")
    for gap in args.pauses:
        times = {"scores": [], "values": []}
        for _ in range(args.calls):
            start = time.perf_counter()
            scores = torch.bmm(query, key.transpose(1, 2))  # (H, 1, K)
            times["scores"].append(time.perf_counter() - start)
            pause(gap)
            shift = scores.amax(dim=-1, keepdim=True)  # (H, 1, 1)
            pause(gap)
            weights = scores.sub_(shift).exp2_()  # (H, 1, K)
            pause(gap)
            total = weights.sum(dim=-1, keepdim=True)  # (H, 1, 1)
            pause(gap)
            start = time.perf_counter()
            torch.bmm(weights, value).div_(total)  # (H, 1, D)
            times["values"].append(time.perf_counter() - start)
        medians = {name: 1e6 * statistics.median(t[20:]) for name, t in times.items()}
        print(
            f"pause {gap:5.0f} µs: score matmul {medians['scores']:5.0f} µs, "
            f"value matmul {medians['values']:5.0f} µs"
        )


if __name__ == "__main__":
    main()
