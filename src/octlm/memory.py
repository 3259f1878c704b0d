"""Memory probes: the peak a process (CPU) or the CUDA allocator reached, and what is free.

CPU: ``ru_maxrss``, the process's lifetime peak resident set (read as VmHWM on Linux, which
leaves out the peak of the process that spawned it; bytes from ``getrusage`` elsewhere); the
baseline is the same figure just before a measured call, so ``peak - baseline`` is what the
call added on top of interpreter, torch and inputs. CUDA: ``max_memory_allocated`` after
``reset_peak_memory_stats``, baseline ``memory_allocated``. Process RSS says nothing about GPU
allocation and is never reported as a GPU figure. Training's metrics and the lab's benchmarks
both read them.
"""

from __future__ import annotations

import resource
import sys

import torch


def metric(device: str) -> str:
    """The name of the memory figure recorded for ``device``."""
    return "cuda_max_allocated" if torch.device(device).type == "cuda" else "ru_maxrss"


def baseline(device: str) -> int:
    """Bytes in use just before the measured call; on CUDA also starts a fresh peak."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return _max_rss()


def peak(device: str) -> int:
    """The peak bytes since :func:`baseline` (CUDA) or since the process began (CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _max_rss()


def _max_rss() -> int:
    """This process's peak resident bytes. On Linux, VmHWM of /proc/self/status: the peak of
    this program's own memory. ``ru_maxrss`` there also carries the peak of the process that
    spawned it (the kernel keeps it across exec), so a worker started by a large driver would
    report the driver's peak as its own baseline and every call's extra memory as 0."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024


def available(device: str) -> int | None:
    """Bytes a new allocation can take without swapping: MemAvailable, or free GPU memory.

    ``None`` where the system does not say (no /proc/meminfo).
    """
    if torch.device(device).type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    return None
