"""Records (DESIGN §5): one JSON object per line, appended and flushed line by line.

A run that is interrupted keeps every line it finished. Every record carries where and with
what it was made: ``experiment``, ``time``, ``torch``, ``device``, ``threads``, ``host_cpu``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import torch


def host_cpu() -> str:
    """The CPU model name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str | torch.device = "cpu") -> str:
    """``cpu``, or the CUDA device's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def context(experiment: str, device: str | torch.device = "cpu") -> dict:
    """The fields every record carries."""
    return {
        "experiment": experiment,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "host_cpu": host_cpu(),
    }


def append(path: str | os.PathLike, record: dict) -> None:
    """Append one record as a line and flush it to disk before returning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record, sort_keys=False) + "\n")
        out.flush()
        os.fsync(out.fileno())


def read(path: str | os.PathLike) -> Iterator[dict]:
    """Records of one file; a torn last line (a run killed mid-write) is skipped."""
    with Path(path).open() as lines:
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
