"""The run's precision: ``--dtype auto`` is bfloat16 autocast where the hardware multiplies
bfloat16 natively, float32 elsewhere.

A CPU with AVX512-BF16 or AMX (x86), or with BF16 (Arm), multiplies bfloat16 matrices faster
than float32 ones; one without them emulates bfloat16 and is several times slower in it. A
CUDA GPU of compute capability 8.0 (Ampere) or later has bfloat16 tensor cores. The choice is
made once, from the hardware, and stored as the resolved dtype in the run's ``config.json``, so
a resumed run keeps it on any machine.
"""

from __future__ import annotations

import torch

from octlm.machine import cpu_flags

AUTO = "auto"
# /proc/cpuinfo flags of bfloat16 matrix units: x86 (flags) and Arm (Features).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def has_bfloat16_units(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (so bfloat16 autocast is faster there)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "cpu":
        return bool((cpu_flags() or frozenset()) & CPU_BF16_FLAGS)
    return False


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``dtype`` as the run computes it on ``device``: ``auto`` becomes bfloat16 where the
    device has bfloat16 units and float32 elsewhere; any other name stays."""
    if dtype != AUTO:
        return dtype
    return "bfloat16" if has_bfloat16_units(device) else "float32"
