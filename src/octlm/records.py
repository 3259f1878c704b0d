"""Records (docs/design.md, 'Records'): one JSON object per line, appended and flushed line by line.

A run that is interrupted keeps every line it finished. Every record says what it is
(``kind``), which run made it (``run``) and where: ``experiment``, ``time``, ``torch``,
``device``, ``threads``, ``host_cpu``, and the rest of the machine (``cpus``, ``cpu_flags``,
``memory_bytes``), so that figures from two machines are never set against each other.
:func:`make` builds every record, :func:`timing` every set of time statistics, and
:func:`read` reads a file once, skipping (and counting) any line that is not a record of a
known kind with fields of the right types.

Kinds: ``bench`` (one measurement, ``octlm bench``), ``ring`` (ring attention over several
processes), ``peak`` (the machine's fp32 matrix-multiply rate), ``verify`` (one equivalence
check), ``train_step`` and ``eval`` (a training run's metrics).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import statistics
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from octlm.machine import cpu_flags, cpu_model, memory_bytes

# Where a machine's own records go unless told: runs/ holds the committed reference records,
# which only `make reference` writes, naming each file.
LOCAL = Path("runs", "local")
KINDS = ("bench", "ring", "peak", "verify", "train_step", "eval", "check")
MACHINE = ("torch", "device", "threads", "host_cpu", "cpus", "cpu_flags", "memory_bytes")
# What tells two machines apart (the device and the thread count vary within one machine).
# A record written before a field existed reads it as None: records that describe their
# machines differently are never merged.
IDENTITY = ("host_cpu", "cpus", "cpu_flags", "memory_bytes", "torch")
# The CPU features that decide which kernels torch runs (x86 and Arm names, /proc/cpuinfo).
SIMD = (
    *("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni"),
    *("amx_tile", "amx_bf16", "amx_fp16", "asimd", "sve", "sve2", "bf16", "i8mm"),
)
NUMBER = (int, float)
SOME_NUMBER = (int, float, type(None))  # a figure that may not have been taken
# What a record of each kind must carry for a report to read it: field -> accepted types.
# ``None`` is accepted only where the tuple names it (a failed measurement has no time).
REQUIRED: dict[str, dict[str, tuple]] = {
    "bench": {"backend": (str,), "mode": (str,), "length": (int,), "status": (str,)},
    "ring": {"mode": (str,), "length": (int,), "world_size": (int,), "status": (str,)},
    "peak": {"gflops": NUMBER},
    "verify": {"experiment": (str,), "check": (str,), "left": (str,), "passed": (bool,)},
    "train_step": {"step": (int,), "loss": NUMBER},
    "eval": {"step": (int,), "val_loss": NUMBER},
    "check": {"experiment": (str,)},  # a side measurement README quotes; the report skips it
}
# A benchmark record's shape and load: a field it has must be of its type (a record without the
# field, as older files hold, reads as the default, so absence is allowed, but not ``null`` where
# the type does not name it).
SHAPED = {
    "dtype": (str,),
    "batch": (int,),
    "heads": (int,),
    "kv_heads": (int,),
    "head_size": (int,),
    "q_len": (int,),
    "causal": (bool,),
    "window": (int,),
    "padding": NUMBER,
    "block": (list, type(None)),
    "busy": (bool,),
    "feature": (str, type(None)),
    "round": (int,),
    "run": (str, type(None)),
    "threads": (int, type(None)),
    **dict.fromkeys(
        ("cpu_seconds", "wall_seconds", "others_seconds", "load_before", "load_after"),
        SOME_NUMBER,
    ),
    "cpus": (int, type(None)),
}
# What a measurement can end as (bench and ring records).
STATUSES = ("ok", "skipped", "unsupported", "oom", "timeout", "killed", "error")
# A training run's records: a diverged run's losses are NaN or infinite, and that is what it did.
TRAINING = ("train_step", "eval")
# Fields an ``ok`` measurement must carry as numbers.
MEASURED = {"seconds_median": NUMBER, "extra_bytes": (int,), "peak_bytes": (int,)}


class RecordsWarning(UserWarning):
    """Lines of a records file were skipped."""


def simd_flags() -> str | None:
    """The :data:`SIMD` features this CPU has, space-separated; None where the system does not
    say."""
    have = cpu_flags()
    return None if have is None else " ".join(flag for flag in SIMD if flag in have)


def identity(record: dict) -> tuple:
    """The machine a record was made on, as :data:`IDENTITY` says it."""
    return tuple(record.get(name) for name in IDENTITY)


def describe_machine(record: dict) -> str:
    """One line naming a record's machine, saying what it does not record."""
    cpu, cpus, flags, memory, version = identity(record)
    parts = [str(cpu or "CPU model not recorded")]
    parts.append(f"{cpus} CPUs" if cpus else "CPU count not recorded")
    features = "CPU features not recorded" if flags is None else f"features: {flags or 'none'}"
    parts.append(features)
    parts.append(f"{memory / 2**30:.0f} GiB memory" if memory else "memory not recorded")
    parts.append(f"torch {version}" if version else "torch version not recorded")
    return ", ".join(parts)


def device_name(device: str | torch.device = "cpu") -> str:
    """``cpu``, or the CUDA device's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def machine(device: str | torch.device = "cpu") -> dict:
    """What this process runs on: torch version, device name, threads, and the machine (CPU
    model, CPU count, SIMD features, memory)."""
    return {
        "torch": torch.__version__,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "host_cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_flags": simd_flags(),
        "memory_bytes": memory_bytes(),
    }


def new_run() -> str:
    """A fresh run id: UTC time to the microsecond, then random hex, so ids sort by time even
    for runs started within one second."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{now}-{uuid.uuid4().hex[:8]}"


def context(experiment: str, where: str | torch.device | dict = "cpu") -> dict:
    """The fields every record carries; ``where`` is a device, or :func:`machine`'s dict as
    a child process reported it (so a CUDA driver need not hold a context of its own)."""
    where = where if isinstance(where, dict) else machine(where)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return {"experiment": experiment, "time": now, **{name: where.get(name) for name in MACHINE}}


def make(
    kind: str,
    experiment: str,
    where: str | torch.device | dict = "cpu",
    *,
    run: str | None = None,
    **fields,
) -> dict:
    """One record: its ``kind`` and ``run``, the :func:`context` fields, then ``fields``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return {"kind": kind, "run": run, **context(experiment, where), **fields}


def timing(seconds: Sequence[float]) -> dict:
    """The time statistics every measurement records: median, interquartile range, and all."""
    if not seconds:
        raise ValueError("seconds must hold at least one timed call, got none")
    quartiles = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else []
    return {
        "seconds_median": statistics.median(seconds),
        "seconds_iqr": quartiles[2] - quartiles[0] if quartiles else 0.0,
        "seconds": list(seconds),
    }


def check_writable(path: str | os.PathLike, option: str) -> Path:
    """Make ``path``'s folder and check that ``path`` can be written, or raise ``ValueError``
    naming ``option``: before the first measurement, not after it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{option} {str(path)!r} cannot be written: {error.strerror}") from None
    if path.is_dir():
        raise ValueError(f"{option} {str(path)!r} cannot be written: it is a folder")
    existed = path.exists()
    try:  # opened, not asked (os.access says yes to root even where writing fails, as in /proc)
        with path.open("ab"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {str(path)!r} cannot be written: {error.strerror}") from None
    if not existed:
        path.unlink(missing_ok=True)
    return path


def append(path: str | os.PathLike, record: dict) -> None:
    """Append one record as a line and flush it to disk before returning.

    A torn last line (a run killed mid-write, a full disk) is ended first, so the new record
    starts on a line of its own and survives. ``OSError`` says which file could not be written.
    """
    path = Path(path)
    line = (json.dumps(record) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as out:
            if out.seek(0, os.SEEK_END) > 0:
                out.seek(-1, os.SEEK_END)
                if out.read(1) != b"\n":
                    line = b"\n" + line
            out.write(line)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        raise OSError(error.errno, f"cannot write a record to {path}: {error.strerror}") from None


@dataclass
class Skipped:
    """Lines of one file that are not records, and why (the first few)."""

    path: str
    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, number: int, why: str) -> None:
        self.count += 1
        if len(self.reasons) < 5:
            self.reasons.append(f"line {number}: {why}")

    def __str__(self) -> str:
        more = "" if self.count <= len(self.reasons) else f"; {self.count - 5} more"
        return f"{self.path}: skipped {self.count} line(s): {'; '.join(self.reasons)}{more}"


def read(path: str | os.PathLike, skipped: list[Skipped] | None = None) -> list[dict]:
    """The records of one file, each with its ``kind`` (inferred for records written before
    kinds existed). Lines that are not UTF-8, not a JSON object, of no known kind or with a
    field of the wrong type are skipped; ``skipped`` (when given) receives their count and
    why, otherwise a :class:`RecordsWarning` says so. ``FileNotFoundError`` names a missing
    file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no records file {str(path)!r}")
    found, bad = [], Skipped(str(path))
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                bad.add(number, "not UTF-8")
                continue
            except json.JSONDecodeError as error:
                bad.add(number, f"not JSON ({error.msg}; a torn line?)")
                continue
            why = _invalid(record)
            if why:
                bad.add(number, why)
                continue
            found.append(record)
    if bad.count:
        if skipped is None:
            warnings.warn(str(bad), RecordsWarning, stacklevel=2)
        else:
            skipped.append(bad)
    return found


def kind_of(record: dict) -> str | None:
    """The record's ``kind``; for one written before kinds existed, what its fields say."""
    if "kind" in record:
        return record["kind"]
    if "check" in record:
        return "verify"
    if "world_size" in record:
        return "ring"
    if "backend" in record:
        return "bench"
    return None


def _invalid(record) -> str | None:
    """Why ``record`` cannot be read as a record, or ``None``; sets its inferred ``kind``."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    kind = kind_of(record)
    if kind not in KINDS:
        return f"kind {kind!r} is none of {KINDS}"
    record["kind"] = kind
    wanted = dict(REQUIRED[kind])
    if kind in ("bench", "ring") and record.get("status") == "ok":
        wanted.update(MEASURED)
    if kind in ("bench", "ring") and record.get("status") not in (*STATUSES, None):
        return f"{kind} record field 'status' must be one of {STATUSES}, got {record['status']!r}"
    for name, types in wanted.items():
        value = record.get(name)
        if not _of_type(value, types):
            return _wrong(kind, name, value, types)
        if isinstance(value, float) and not math.isfinite(value) and kind not in TRAINING:
            return f"{kind} record field {name!r} must be finite, got {value!r}"
    if kind in ("bench", "peak"):
        for name, types in SHAPED.items():
            value = record.get(name, types[0]())  # absent: the default
            if not _of_type(value, types):
                return _wrong(kind, name, value, types)
    positive = {"bench": "seconds_median", "peak": "gflops"}.get(kind)
    if positive in record and record.get("status", "ok") == "ok" and not record[positive] > 0:
        return f"{kind} record field {positive!r} must be > 0, got {record[positive]!r}"
    return None


def _of_type(value, types: tuple) -> bool:
    """``isinstance``, except that a bool is no int unless ``types`` names bool."""
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _wrong(kind: str, name: str, value, types: tuple) -> str:
    expected = " or ".join(t.__name__ for t in types)
    return f"{kind} record field {name!r} must be {expected}, got {value!r}"
