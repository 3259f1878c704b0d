"""Would splitting one decoding step across threads by hand beat PyTorch's own threading?

One query row of 8 heads of 32 against ``--keys`` cached keys, float32, on all of
``torch.get_num_threads()`` threads. Interleaved, call by call (the order alternating), the
median of ``--calls`` calls each of:

- ``sdpa``: ``F.scaled_dot_product_attention`` with no mask (one row sees every key);
- ``plain``: the fewest PyTorch operations of one softmax over the keys (score product,
  maximum, exponential, sum, value product, division), with PyTorch's intra-op threads;
- ``heads``: the same, the heads split in two halves run on two Python threads with
  single-threaded operations (``octlm.attention.tiled.threads.parallel_map``);
- ``keys``: the same, the keys split in two halves, their partial results merged exactly.

Prints each median and the largest difference from SDPA's output. ``--variants`` picks some:
the split ones change PyTorch's thread count while they run (``parallel_map`` sets it to 1 and
back), which slows whatever runs after them, so measure them in a process of their own. Run
it alone::

    python benchmarks/decode_split_probe.py --keys 8192 --variants sdpa plain
    python benchmarks/decode_split_probe.py --keys 8192 --variants heads keys
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from octlm.attention.tiled.threads import parallel_map

HEADS, HEAD_SIZE = 8, 32
LOG2E = math.log2(math.e)


def softmax_rows(query, key, value):
    """``(H, 1, D)`` against ``(H, K, D)``: the output, its shift and its sum, base 2."""
    weights = torch.bmm(query, key.transpose(1, 2))  # (H, 1, K)
    shift = weights.amax(dim=-1, keepdim=True)  # (H, 1, 1)
    weights.sub_(shift).exp2_()
    total = weights.sum(dim=-1, keepdim=True)  # (H, 1, 1)
    return torch.bmm(weights, value), shift, total  # (H, 1, D), unnormalised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument(
        "--variants", nargs="+", choices=("sdpa", "plain", "heads", "keys"),
        default=["sdpa", "plain"],
    )  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    keys = args.keys
    query = torch.randn(1, HEADS, 1, HEAD_SIZE)
    # A cache's view of its longer buffer, as decoding sees it.
    key = torch.randn(1, HEADS, keys + 64, HEAD_SIZE)[:, :, :keys]
    value = torch.randn(1, HEADS, keys + 64, HEAD_SIZE)[:, :, :keys]
    scaled = (query * (HEAD_SIZE**-0.5 * LOG2E)).view(HEADS, 1, HEAD_SIZE)

    def plain():
        out, _, total = softmax_rows(scaled, key[0], value[0])
        return out.div_(total)

    def heads():
        halves = [slice(0, HEADS // 2), slice(HEADS // 2, HEADS)]
        parts = parallel_map(
            lambda h: plain_part(scaled[h], key[0][h], value[0][h]), halves, query.device
        )
        return torch.cat(parts)

    def plain_part(q, k, v):
        out, _, total = softmax_rows(q, k, v)
        return out.div_(total)

    def split_keys():
        halves = [slice(0, keys // 2), slice(keys // 2, keys)]
        parts = parallel_map(
            lambda h: softmax_rows(scaled, key[0][:, h], value[0][:, h]), halves, query.device
        )
        (first, shift_a, total_a), (second, shift_b, total_b) = parts
        shift = torch.maximum(shift_a, shift_b)
        a, b = torch.exp2(shift_a - shift), torch.exp2(shift_b - shift)
        return (first * a + second * b) / (total_a * a + total_b * b)

    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(query, key, value).view(HEADS, 1, -1),
        "plain": plain,
        "heads": heads,
        "keys": split_keys,
    }
    reference = calls["sdpa"]()
    calls = {name: calls[name] for name in args.variants}
    for name, call in calls.items():
        error = (call() - reference).abs().max().item()
        print(f"{name:6s} max |difference| from sdpa {error:.1e}")
    for call in calls.values():  # warm-up
        for _ in range(20):
            call()
    times = {name: [] for name in calls}
    names = list(calls)
    for index in range(args.calls):
        for name in names if index % 2 else names[::-1]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    print(f"\n{torch.get_num_threads()} threads, {keys} keys, {args.calls} calls each, interleaved")
    for name in names:
        print(f"{name:6s} median {statistics.median(times[name]) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
