"""The one timing loop of every benchmark: warm-up calls, timed calls, and how busy it all was.

Every suite times its calls with :func:`time_calls`, so one rule holds for all of them: each
call is timed from ``fence()`` to ``fence()`` after it (CUDA synchronised, or the ranks of a
ring at a barrier), the warm-up calls are not timed, and the figures carry the CPU time the
process got against the wall time, the CPU time every other process used meanwhile, and the
load average before and after, so a figure taken on a busy machine says so itself. The
statistics of the times are :func:`octlm.records.timing`.

This file imports nothing from torch, so a suite that runs no tensors pays nothing for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """The seconds of each timed call, and the process's CPU and wall seconds over all of them,
    the CPU seconds other processes used over the same span (``None`` without ``/proc/stat``),
    with the one-minute load average just before the first and just after the last."""

    seconds: list[float]
    cpu_seconds: float
    wall_seconds: float
    load_before: float | None
    load_after: float | None
    others_seconds: float | None = None

    def cpu_share(self, threads: int) -> float:
        """CPU seconds per wall second per thread: 1 when every thread had its core."""
        return self.cpu_seconds / (self.wall_seconds * threads) if self.wall_seconds else 0.0


def load() -> float | None:
    """The one-minute load average, where the system has one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux's ``/proc/stat``,
    time stolen by a hypervisor included), or ``None`` where there is no such file."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def time_calls(
    call: Callable[[], object],
    repeats: int,
    *,
    warmup: int = 0,
    fence: Callable[[], object] | None = None,
) -> Timing:
    """Call ``call`` ``warmup`` times untimed, then ``repeats`` times, each timed on its own."""
    fence = fence or (lambda: None)
    for _ in range(warmup):
        call()
    load_before = load()
    machine = machine_cpu_seconds()
    cpu, wall = time.process_time(), time.perf_counter()
    seconds = []
    for _ in range(repeats):
        fence()
        start = time.perf_counter()
        call()
        fence()
        seconds.append(time.perf_counter() - start)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    others = None if machine is None else max(0.0, machine_cpu_seconds() - machine - cpu)
    return Timing(seconds, cpu, wall, load_before, load(), others)


def device_fence(device) -> Callable[[], object] | None:
    """What a call on ``device`` (a ``torch.device``) waits for before its clock stops: CUDA's
    queued kernels; nothing on a CPU."""
    if device.type != "cuda":
        return None
    import torch

    return lambda: torch.cuda.synchronize(device)
