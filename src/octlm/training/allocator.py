"""glibc's allocator set to keep large freed blocks in the process for the next step.

A training step on CPU allocates and frees the same large tensors every step: the logits, their
log-softmax and its gradient are 32 MiB each at a batch of 16 x 128 tokens and a vocabulary of
4,096. glibc serves an allocation above its mmap threshold (which it moves up to at most
32 MiB) with fresh pages from the kernel and unmaps them on free, so every step pays the page
faults and the zero-filling of those pages again. Raising the mmap and trim thresholds keeps
such blocks in the heap, where the next step reuses them. The cost is a resident size that
stays near the run's peak instead of falling between steps. The measured effect on a
training step is in docs/training.md, 'Precision and memory'.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from and go back to the heap; larger ones are still mapped.
KEEP_BYTES = 1 << 30
# The environment variables through which a user sets glibc's thresholds; set, they win.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to :data:`KEEP_BYTES` for this process.

    Returns whether they were set: not on systems other than Linux with glibc, and not where
    the environment already sets the allocator (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), which is the user's choice to keep. A
    process-wide setting: :func:`octlm.training.train` calls it for CPU runs; a library that
    only runs models never does.
    """
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a C library without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
