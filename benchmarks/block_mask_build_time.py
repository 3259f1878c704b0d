"""How long ``block_mask(...)`` takes to build, beside the tiled forward it serves.

Batch 1, 8 heads of 32, 8,192 tokens, float32, the default tiles (512, 256), three patterns:
causal, 8 documents of 1,024 (causal), and a sliding window of 512. Prints the median (and
min, max) of 7 builds after one warm-up, and of 3 tiled forwards given the map, per pattern.
Which octlm it measures is whatever ``PYTHONPATH`` puts first, so two revisions can be run
one after the other::

    PYTHONPATH=/path/to/old/src python benchmarks/block_mask_build_time.py
    PYTHONPATH=src python benchmarks/block_mask_build_time.py
"""

import os
import statistics
import time

import torch

from octlm.attention import block_mask, tiled_attention
from octlm.attention.block_masks import causal_mod, document_mod, sliding_window_mod

LENGTH, HEADS = 8192, 8


def timed(call, repeats: int) -> str:
    call()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    low, middle, high = (1e3 * f(seconds) for f in (min, statistics.median, max))
    return f"median {middle:7.1f} ms (min {low:.1f}, max {high:.1f})"


ids = (torch.arange(LENGTH) * 8 // LENGTH).unsqueeze(0)  # (1, T): 8 documents of 1,024
patterns = {
    "causal": causal_mod(LENGTH, LENGTH),
    "documents": document_mod(ids, LENGTH),
    "window 512": sliding_window_mod(LENGTH, LENGTH, 512),
}
torch.manual_seed(0)
q, k, v = (torch.randn(1, HEADS, LENGTH, 32) for _ in range(3))
print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
for name, pattern in patterns.items():
    build = timed(lambda p=pattern: block_mask(p, 1, HEADS, LENGTH, LENGTH), 7)
    mask = block_mask(pattern, 1, HEADS, LENGTH, LENGTH)
    with torch.no_grad():
        forward = timed(lambda m=mask: tiled_attention(q, k, v, causal=False, block_mask=m), 3)
    print(f"{name:10s}  build {build}   tiled forward {forward}")
print(f"load average {os.getloadavg()}")
