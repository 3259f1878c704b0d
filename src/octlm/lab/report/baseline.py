"""The baseline: the figures this project started from, beside this machine's.

The baseline is one first measurement on a laptop CPU: SDPA's MATH backend (the plain
softmax(QKᵀ)V, which builds the whole score matrix) against its FLASH backend (a fused kernel
that never does), with the memory-efficient backend tried, at batch 1, 8 heads of 32, causal,
forward, float32 and bfloat16. It also sketched a blocking of the computation in plain PyTorch
(``sketch``, bench/sketch.py), which octlm's tiled attention grew from. Each row puts a
baseline figure beside the one computed from this machine's records.
"""

from __future__ import annotations

import math
from collections import Counter

from octlm.lab.bench.worker import NO_KERNEL
from octlm.lab.report.collect import backend_label, machine_of, plain
from octlm.lab.report.format import NOT_MEASURED, filled_by, mib, ratio, seconds, table

# The baseline's benchmark shape, which its figures are about.
BASELINE_SHAPE = {"batch": 1, "heads": 8, "kv_heads": 8, "head_size": 32, "causal": True}
FLASH32, TILED32 = dict(backend="flash", dtype="float32"), dict(backend="tiled", dtype="float32")
HEADER = ["What", "Baseline (laptop CPU)", "This machine"]
# Part of a figure without records (a whole figure without them is NOT_MEASURED).
NO_RECORDS = "no records"


def baseline_rows(rows: list[dict], mode: str = "forward") -> list[dict]:
    """Plain CPU records of the baseline's shape, in ``mode``, of one machine: the one (with
    its thread count, CPU and torch) that has the most of them, so no figure sets one machine's
    time over another's."""
    found = [
        r
        for r in rows
        if r.get("device") == "cpu"
        and r["mode"] == mode
        and plain(r)
        and backend_label(r) == r["backend"]  # tiled at its default tiles
        and all(r.get(name) == value for name, value in BASELINE_SHAPE.items())
    ]
    counts = Counter(machine_of(r) for r in rows if r.get("device") == "cpu" and plain(r))
    machine = max(counts, key=lambda m: (counts[m], str(m)), default=None)
    return [r for r in found if machine_of(r) == machine]


def ok_by_length(rows: list[dict], **want) -> dict[int, dict]:
    """``{length: record}`` of the ok records that match ``want``."""
    return {
        r["length"]: r
        for r in rows
        if r["status"] == "ok" and all(r.get(name) == value for name, value in want.items())
    }


def common_length(preferred: int, *series: dict[int, dict]) -> int | None:
    """``preferred`` when every series has it, else the longest length they share."""
    shared = set.intersection(*(set(s) for s in series)) if series else set()
    if preferred in shared:
        return preferred
    return max(shared, default=None)


def _growth(small: dict, large: dict) -> float:
    """Factor per doubling of length from ``small`` to ``large`` (geometric mean)."""
    doublings = math.log2(large["length"] / small["length"])
    return (large["extra_bytes"] / max(small["extra_bytes"], 1)) ** (1 / doublings)


def comparison(rows: list[dict]) -> list[list[str]]:
    """Rows of (what, the baseline's figure, this machine's figure)."""
    forward, train = baseline_rows(rows), baseline_rows(rows, "train")
    return [
        [
            "MATH memory per doubling of length",
            "about 4× (107 MiB at 1,024 → 4,928 MiB at 8,192)",
            _math_growth(forward),
        ],
        ["FLASH memory stays flat", "59 MiB at 8,192", _flash_flat(forward)],
        ["FLASH speed-up over MATH, float32", "10.5× at 8,192", _speedup(forward)],
        [
            "bfloat16 against float32 time",
            "bfloat16 slower than float32 for MATH and FLASH",
            _bf16(forward),
        ],
        ["memory-efficient backend on CPU", "no CPU kernel", _efficient(rows)],
        [
            "tiled against FLASH, forward float32",
            "none: tiled was only sketched",
            _tiled_vs_flash(forward),
        ],
        [
            "tiled against the blocking sketch it grew from, forward float32",
            "none: the sketch was not timed",
            _tiled_vs_sketch(forward),
        ],
        [
            "tiled bfloat16 against tiled float32",
            "none",
            _tiled_bf16(forward),
        ],
        [
            "training time (forward + backward): tiled against FLASH, float32",
            "none: forward only",
            _train_time(train),
        ],
        [
            "training at 16,384 tokens, float32",
            "none",
            _train_long(train),
        ],
        [
            "training memory: tiled against FLASH and MATH",
            "none: forward only",
            _train_memory(train),
        ],
    ]


def section(rows: list[dict]) -> list[str]:
    """The comparison table of the figures this machine has, then one line per command
    naming those it lacks."""
    found = comparison(rows)
    lacking: dict[str, list[str]] = {}
    for number, (what, _baseline, here) in enumerate(found):
        if here == NOT_MEASURED or all(part.endswith(NO_RECORDS) for part in here.split("; ")):
            lacking.setdefault("train" if number >= len(found) - 3 else "baseline", []).append(what)
    shown = [row for row in found if not any(row[0] in names for names in lacking.values())]
    lines = table(HEADER, shown) if shown else []
    for command, names in lacking.items():
        lines += [filled_by(command, "No records of: " + "; ".join(names)), ""]
    return lines


def _math_growth(rows: list[dict]) -> str:
    math_rows = ok_by_length(rows, backend="math", dtype="float32")
    if len(math_rows) < 2:
        return NOT_MEASURED
    small, large = math_rows[min(math_rows)], math_rows[max(math_rows)]
    return (
        f"{ratio(_growth(small, large))} ({mib(small)} at {small['length']:,} → "
        f"{mib(large)} at {large['length']:,})"
    )


def _flash_flat(rows: list[dict]) -> str:
    flash = ok_by_length(rows, backend="flash", dtype="float32")
    if not flash:
        return NOT_MEASURED
    large = flash[common_length(8192, flash)]
    text = f"{mib(large)} at {large['length']:,}"
    if min(flash) < large["length"]:
        text += f" ({ratio(_growth(flash[min(flash)], large))} per doubling)"
    return text


def _timeratio(rows: list[dict], top: dict, bottom: dict) -> tuple[float, int] | None:
    """Median time of ``top`` over ``bottom`` (record filters) at 8,192 or the longest shared
    length, and that length; None when they share none."""
    over, under = ok_by_length(rows, **top), ok_by_length(rows, **bottom)
    length = common_length(8192, over, under)
    if length is None:
        return None
    return over[length]["seconds_median"] / under[length]["seconds_median"], length


def _speedup(rows: list[dict]) -> str:
    found = _timeratio(rows, dict(backend="math", dtype="float32"), FLASH32)
    return NOT_MEASURED if found is None else f"{ratio(found[0])} at {found[1]:,}"


def _bf16(rows: list[dict]) -> str:
    parts = []
    for backend, name in (("math", "MATH"), ("flash", "FLASH")):
        found = _timeratio(
            rows, dict(backend=backend, dtype="bfloat16"), dict(backend=backend, dtype="float32")
        )
        if found is None:
            parts.append(f"{name}: {NO_RECORDS}")
            continue
        times, length = found
        verdict = "slower" if times > 1 else "faster"
        parts.append(f"{name}: {ratio(times)} the float32 time at {length:,} ({verdict})")
    return "; ".join(parts)


def _efficient(rows: list[dict]) -> str:
    tried = [r for r in rows if r.get("device") == "cpu" and r["backend"] == "efficient"]
    if not tried:
        return NOT_MEASURED
    unsupported = [r for r in tried if r["status"] == "unsupported"]
    if len(unsupported) < len(tried):
        return f"ran: {len(tried) - len(unsupported)} of {len(tried)} measurements ok"
    reason = unsupported[0].get("reason") or ""
    if any(text in reason for text in NO_KERNEL):  # torch: "turning off ... fused kernels"
        return f"no CPU kernel: torch has this backend for CUDA only ({len(tried)} refused)"
    return f"unsupported in all {len(tried)} measurements: {reason}"


def _tiled_vs_flash(rows: list[dict]) -> str:
    tiled = ok_by_length(rows, backend="tiled", dtype="float32")
    flash = ok_by_length(rows, backend="flash", dtype="float32")
    length = common_length(8192, tiled, flash)
    if length is None:
        return NOT_MEASURED
    t, f = tiled[length], flash[length]
    return (
        f"time {ratio(t['seconds_median'] / f['seconds_median'])} FLASH, extra memory "
        f"{mib(t)} vs {mib(f)} ({ratio(t['extra_bytes'] / max(f['extra_bytes'], 1))}) "
        f"at {length:,}"
    )


def _tiled_vs_sketch(rows: list[dict]) -> str:
    found = _timeratio(rows, dict(backend="sketch", dtype="float32"), TILED32)
    return NOT_MEASURED if found is None else f"{ratio(found[0])} faster at {found[1]:,}"


def _tiled_bf16(rows: list[dict]) -> str:
    found = _timeratio(rows, dict(backend="tiled", dtype="bfloat16"), TILED32)
    return NOT_MEASURED if found is None else f"{ratio(found[0])} the float32 time at {found[1]:,}"


def _train_time(rows: list[dict]) -> str:
    found = _timeratio(rows, TILED32, FLASH32)
    return NOT_MEASURED if found is None else f"{ratio(found[0])} FLASH's time at {found[1]:,}"


def _train_long(rows: list[dict]) -> str:
    parts = []
    for backend in ("tiled", "flash", "math"):
        found = [
            r
            for r in rows
            if r["backend"] == backend and r["length"] == 16384 and r["dtype"] == "float32"
        ]
        found.sort(key=lambda r: r["status"] != "ok")  # a figure before a failure
        if not found:
            parts.append(f"{backend}: {NO_RECORDS}")
        elif found[0]["status"] == "ok":
            parts.append(f"{backend} {seconds(found[0]['seconds_median'])}, {mib(found[0])}")
        else:
            parts.append(f"{backend} {found[0]['status']} ({found[0].get('reason')})")
    return "; ".join(parts)


def _train_memory(rows: list[dict]) -> str:
    tiled = ok_by_length(rows, backend="tiled", dtype="float32")
    parts = []
    for backend, name in (("flash", "FLASH"), ("math", "MATH")):
        other = ok_by_length(rows, backend=backend, dtype="float32")
        length = common_length(8192, tiled, other)
        if length is None:
            parts.append(f"vs {name}: {NO_RECORDS}")
            continue
        t, o = tiled[length], other[length]
        parts.append(
            f"tiled {mib(t)} vs {name} {mib(o)} "
            f"({ratio(t['extra_bytes'] / max(o['extra_bytes'], 1))}) at {length:,}"
        )
    return "; ".join(parts)
