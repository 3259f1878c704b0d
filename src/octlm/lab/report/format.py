"""Formatting shared by the report's sections: sizes, times, ratios, Markdown tables."""

from __future__ import annotations

import statistics

from octlm.lab.report.collect import busy

MiB = 2**20
NOT_MEASURED = "not measured"
# The command that measures each kind of record, named where a report has none of them.
COMMANDS = {
    "baseline": "octlm bench baseline",
    "train": "octlm bench train",
    "structure": "octlm bench structure",
    "route": "octlm bench route",
    "contention": "octlm bench baseline --backends flash tiled --lengths 8192 --busy",
    "ring": "octlm bench ring",
    "training": "octlm bench training --what attention",
    "verify": "octlm verify",
}
BUSY_MARK = "†"
BUSY_NOTE = (
    f"{BUSY_MARK} measured while the machine was busy (other processes used more than a quarter "
    "of a CPU while it was timed; for older records, the process got under three quarters of "
    "its threads' CPU time, or the load average was above the CPU count): treat it with care."
)


def filled_by(what: str, text: str = "No records yet") -> str:
    """``text``, naming the command whose records would fill it in."""
    return f"{text} (`{COMMANDS[what]}`)"


def mib(record: dict) -> str:
    """The record's extra memory (peak minus baseline) in MiB."""
    return f"{record['extra_bytes'] / MiB:,.0f} MiB"


def seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def ratio(value: float) -> str:
    return f"{value:.3g}×"


def spread(values: list[float]) -> str:
    """``median× (min–max, n)`` of ratios over rounds."""
    if len(values) == 1:
        return f"{ratio(values[0])} (1 round)"
    low, high = min(values), max(values)
    return f"{ratio(statistics.median(values))} ({low:.3g}–{high:.3g}, {len(values)} rounds)"


def table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return [*lines, ""]


def is_ok(record: dict | None) -> bool:
    return record is not None and record["status"] == "ok"


def cell(record: dict | None) -> str:
    """``time, memory`` of an ok record, marked when the machine was busy; else its status;
    a dash where there is no record."""
    if record is None:
        return "—"
    if record["status"] != "ok":
        return record["status"]
    text = f"{seconds(record['seconds_median'])}, {mib(record)}"
    if record.get("device") != "cpu" and record.get("tflops"):
        text += f", {record['tflops']:.3g} TFLOP/s"
    return text + (f" {BUSY_MARK}" if busy(record) else "")
