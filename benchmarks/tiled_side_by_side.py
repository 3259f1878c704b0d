"""Tiled attention of two checkouts side by side: one measurement per process.

Measures ``tiled`` or SDPA's FLASH backend at batch 1, 8 heads of 32, 8,192 tokens, causal,
float32, ``forward`` or ``train`` (forward + backward), and prints one JSON line (median of 5
after 2 warm-ups, wall and CPU seconds, the load average). Which octlm it measures is whatever
``PYTHONPATH`` puts first, so two revisions can be interleaved round by round::

    for round in 1 2 3; do for mode in forward train; do
      PYTHONPATH=src python benchmarks/tiled_side_by_side.py flash $mode new >> out.jsonl
      PYTHONPATH=old/src python benchmarks/tiled_side_by_side.py tiled $mode old >> out.jsonl
      PYTHONPATH=src python benchmarks/tiled_side_by_side.py tiled $mode new >> out.jsonl
    done; done

``runs/checks/tiled-before-after-exactness.jsonl`` was made this way.
"""

import json
import os
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import octlm
from octlm.attention import tiled_attention

backend, mode, which = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, 8192, 32, requires_grad=(mode == "train")) for _ in range(3))


def call():
    if backend == "tiled":
        out = tiled_attention(q, k, v)
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mode == "train":
        out.sum().backward()


for _ in range(2):
    call()
wall, cpu = [], []
for _ in range(5):
    t, c = time.perf_counter(), time.process_time()
    call()
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
print(
    json.dumps(
        {
            "kind": "check",
            "experiment": "tiled-old-vs-new",
            "code": which,
            "backend": backend,
            "mode": mode,
            "length": 8192,
            "heads": 8,
            "head_size": 32,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "octlm_path": os.path.dirname(octlm.__file__),
            "seconds": wall,
            "seconds_median": statistics.median(wall),
            "cpu_seconds_median": statistics.median(cpu),
            "load_before": os.getloadavg()[0],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
)
