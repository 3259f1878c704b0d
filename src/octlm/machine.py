"""What machine this is, as Linux tells it: the CPU's model and feature flags, the memory.

Records carry these so that reports keep machines apart (:mod:`octlm.records`), and
``--dtype auto`` reads the flags to tell whether the CPU multiplies bfloat16 natively
(:mod:`octlm.training.precision`). Elsewhere than Linux they say what they can.
"""

from __future__ import annotations

import platform


def _cpuinfo_field(*names: str) -> str | None:
    """The value of the first line of /proc/cpuinfo named one of ``names``; None where the
    file or the line is missing."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU model name (``platform`` where /proc/cpuinfo does not say)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); None where unknown."""
    listed = _cpuinfo_field("flags", "Features")
    return None if listed is None else frozenset(listed.split())


def memory_bytes() -> int | None:
    """The machine's memory (MemTotal), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError):
        pass
    return None
