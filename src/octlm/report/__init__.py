"""``octlm report``: the Day 2 note's claims beside this machine's figures, tables and plots.

Every number in the report is computed from records (docs/design.md §5); none is typed in, and
what the records lack reads "not measured". Each file is read once and its records dispatched
by kind (:mod:`octlm.report.collect`); each section is one module:

- :mod:`~octlm.report.claims`: the Day 2 note's claims, rerun here.
- :mod:`~octlm.report.rounds`: ratios within a round, contention, the matmul peak.
- :mod:`~octlm.report.equivalence`: ``octlm verify``'s worst figures.
- :mod:`~octlm.report.structure`: window, prefill, decode and padding against a dense mask.
- :mod:`~octlm.report.route`: ``attention="auto"`` against the faster of FLASH and tiled.
- :mod:`~octlm.report.ring`: ring attention over several processes.
- :mod:`~octlm.report.train_steps`: tokens per second of training with each attention.
- :mod:`~octlm.report.training`: a training run's metrics, when its file is given.
- :mod:`~octlm.report.plots` and :mod:`~octlm.report.measurements`: every plain measurement.

Times are medians over the repeats (over the rounds, the median of the rounds' medians);
memory is ``extra_bytes``, the peak minus the baseline just before the call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from octlm import records
from octlm.report import claims as day2
from octlm.report import (
    equivalence,
    measurements,
    ring,
    rounds,
    route,
    structure,
    train_steps,
    training,
)
from octlm.report.claims import claims
from octlm.report.collect import Collected, busy, collect
from octlm.report.format import BUSY_NOTE, NOT_MEASURED, table
from octlm.report.plots import plot

__all__ = ["NOT_MEASURED", "claims", "collect", "load", "write_report"]


def load(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Benchmark records of ``paths``, one per measurement and device (idle runs only)."""
    return collect(paths).bench


def write_report(
    paths: Iterable[str | os.PathLike] | None = None, output: str | os.PathLike = "runs/report.md"
) -> Path:
    """Write ``output`` (Markdown) and its PNG plots beside it; return the Markdown's path.

    ``paths`` defaults to every ``runs/*.jsonl``. ``FileNotFoundError`` names a missing input;
    ``ValueError`` an output that cannot be written. Skipped lines are listed in the report
    and on stderr.
    """
    output = records.check_writable(output, "output (--output)")
    paths = sorted(Path("runs").glob("*.jsonl")) if paths is None else [Path(p) for p in paths]
    if any(p.exists() and output.exists() and p.samefile(output) for p in paths):
        raise ValueError(f"output (--output) {str(output)!r} is one of the records read")
    found = collect(paths)
    for note in found.skipped:
        print(f"octlm report: {note}", file=sys.stderr)
    lines = ["# octlm benchmark report", "", *_sources(found)]
    if found.count:
        lines += _sections(found, output.parent)
    output.write_text("\n".join(lines) + "\n")
    return output


def _sections(found: Collected, folder: Path) -> list[str]:
    rows = found.bench
    lines = ["## The Day 2 note's claims on this machine", ""]
    lines += table(day2.HEADER, claims(rows))
    lines += ["## Ratios within a round, and under contention", ""]
    lines += rounds.section(found)
    lines += ["## Equivalence (`octlm verify`)", ""]
    lines += equivalence.section(found.verify)
    lines += ["## Structure cases: tiled against SDPA with a dense mask", ""]
    lines += structure.section(rows)
    lines += ['## `attention="auto"` against the faster of FLASH and tiled', ""]
    lines += route.section(found)
    lines += ["## Context parallel: ring attention over W processes (`octlm.bench.ring`)", ""]
    lines += ring.section(found.ring)
    if found.train_attention:
        lines += ["## Training steps with each attention (`octlm bench --suite training`)", ""]
        lines += train_steps.section(found.train_attention)
    if found.train:
        lines += ["## Training run", ""]
        lines += training.section(found.train)
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in plot(rows, folder)] or [NOT_MEASURED]
    lines += ["", "## Every measurement without window, padding or cache", ""]
    lines += measurements.section(rows)
    return lines


def _sources(found: Collected) -> list[str]:
    """Where the records came from, on what machines, what was skipped and what was busy."""
    names = ", ".join(f"`{p}`" for p in found.paths) or "no files"
    if not found.count:
        lines = [f"No records in {names}: nothing was measured, so this report has no figures."]
        return [*lines, *(f"- {note}" for note in found.skipped), ""]
    rows = found.bench
    lines = [
        f"{found.count} records from {names}: {len(rows)} benchmark measurements, "
        f"{len(found.verify)} verification checks, {len(found.ring)} ring measurements, "
        f"{len(found.train)} training metrics, {len(found.train_attention)} training-step "
        "measurements.",
        "",
    ]
    lines += [f"- skipped: {note}" for note in found.skipped]
    machines = sorted(
        {(r.get("device"), r.get("host_cpu"), r.get("threads"), r.get("torch")) for r in rows},
        key=str,
    )
    lines += [
        f"- **{device}**: host CPU {cpu}, {threads} threads, torch {torch}"
        for device, cpu, threads, torch in machines
    ] or ["- no benchmark records: every benchmark figure below is " + NOT_MEASURED]
    # --busy's own rounds are busy by design: only an idle one that was not is worth a mark.
    idle = [r for r in found.rounds.values() if r["status"] == "ok" and not r.get("busy")]
    flagged = [r for r in idle if busy(r)]
    if flagged:
        lines += [
            f"- {len(flagged)} of {len(idle)} idle measurements (rounds counted one by one) were "
            f"taken while the machine was busy (for example {busy(flagged[0])}); they are "
            "marked †."
        ]
    return [
        *lines,
        "",
        "Times are medians over the repeats (several rounds: the median of the rounds). Memory "
        "is the extra bytes of the call: peak minus the baseline taken just before it (CPU: "
        "`ru_maxrss`; CUDA: `max_memory_allocated`). " + BUSY_NOTE,
        "",
    ]
