"""``octlm report``: this machine's figures beside the baseline's, tables and plots; or, given
a training run, that run's report.

Every number in the report is computed from records (docs/design.md, 'Records'); none is typed in. A
section without records is one line naming the command that measures it. Records of different
machines (:func:`octlm.records.identity`) are reported apart, never set against each other.
Each file is read once and its records dispatched by kind (:mod:`octlm.lab.report.collect`); each
section is one module:

- :mod:`~octlm.lab.report.baseline`: the figures this project started from, beside this machine's.
- :mod:`~octlm.lab.report.rounds`: ratios within a round, contention, the matmul peak.
- :mod:`~octlm.lab.report.equivalence`: ``octlm verify``'s worst figures.
- :mod:`~octlm.lab.report.structure`: window, prefill, decode and padding against a dense mask.
- :mod:`~octlm.lab.report.route`: ``attention="auto"`` against the faster of FLASH and tiled.
- :mod:`~octlm.lab.report.ring`: ring attention over several processes.
- :mod:`~octlm.lab.report.train_steps`: tokens per second of training with each attention.
- :mod:`~octlm.lab.report.plots` and :mod:`~octlm.lab.report.measurements`: every plain measurement.
- :mod:`~octlm.lab.report.training`: the report of a training run (its folder or metrics.jsonl).

Times are medians over the repeats (over the rounds, the median of the rounds' medians);
memory is ``extra_bytes``, the peak minus the baseline just before the call.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from octlm import records
from octlm.lab.report import (
    baseline,
    equivalence,
    measurements,
    ring,
    rounds,
    route,
    structure,
    train_steps,
    training,
)
from octlm.lab.report.baseline import comparison
from octlm.lab.report.collect import Collected, busy, by_machine, collect
from octlm.lab.report.format import BUSY_NOTE, NOT_MEASURED, filled_by
from octlm.lab.report.plots import plot

__all__ = ["DEFAULT_OUTPUT", "NOT_MEASURED", "collect", "comparison", "load", "write_report"]

# Where a report goes unless told: not the committed runs/report.md, which `make reference`
# writes by naming it.
DEFAULT_OUTPUT = records.LOCAL / "report.md"
TRAINING_OUTPUT = records.LOCAL / "training-report.md"


def load(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Benchmark records of ``paths``, one per measurement and device (idle runs only)."""
    return collect(paths).bench


def write_report(
    paths: Iterable[str | os.PathLike] | None = None,
    output: str | os.PathLike | None = None,
) -> Path:
    """Write ``output`` (Markdown) and its PNG plots beside it; return the Markdown's path.

    ``paths`` defaults to every ``runs/local/*.jsonl`` (this machine's own records; the
    committed reference records are ``runs/*.jsonl``); a training run's folder (or its
    metrics.jsonl) gives that run's report instead. ``output`` defaults to
    ``runs/local/report.md`` for records, to ``report.md`` in the run's folder for one run, and
    to ``runs/local/training-report.md`` for several, so no report replaces another.
    ``FileNotFoundError`` names a missing input; ``ValueError`` an output that cannot be
    written, or training runs given with benchmark records. Skipped lines are listed in the
    report and on stderr.
    """
    paths = sorted(records.LOCAL.glob("*.jsonl")) if paths is None else [Path(p) for p in paths]
    paths = [training.metrics_of(p) if p.is_dir() else p for p in paths]
    if output is None:
        runs = [p for p in paths if p.name == training.METRICS]
        if len(runs) == 1 and len(paths) == 1:
            output = runs[0].parent / "report.md"
        else:
            output = TRAINING_OUTPUT if runs and len(runs) == len(paths) else DEFAULT_OUTPUT
    output = records.check_writable(output, "output (--output)")
    if any(p.exists() and output.exists() and p.samefile(output) for p in paths):
        raise ValueError(f"output (--output) {str(output)!r} is one of the records read")
    found, machines = by_machine(paths)
    for note in found.skipped:
        print(f"octlm report: {note}", file=sys.stderr)
    if found.train:
        if found.count != len(found.train):
            raise ValueError(
                "training runs and benchmark records make separate reports: give "
                "`octlm report` the run folders alone, then the benchmark records alone"
            )
        lines = training.report(found.train, output)
    else:
        lines = ["# octlm benchmark report", "", *_sources(found, machines)]
        if len(machines) == 1:
            lines += _sections(machines[0], output, level=2)
        for number, part in enumerate(machines if len(machines) > 1 else [], 1):
            lines += [f"## Machine {number}: {_describe(part)}", ""]
            lines += _sections(part, output, level=3, prefix=f"machine-{number}-")
    output.write_text("\n".join(lines) + "\n")
    return output


def _sections(found: Collected, output: Path, level: int, prefix: str = "") -> list[str]:
    rows = found.bench
    title = "#" * level + " "

    def section(heading: str, body: list[str]) -> list[str]:
        deeper = "#" * (level - 2)  # the sections' own subsections, one level down
        return [title + heading, "", *(deeper + line if line[:1] == "#" else line for line in body)]

    lines = section(
        "Baseline: the figures this project started from, beside this machine's",
        [
            "The baseline is a first measurement on a laptop CPU: SDPA's MATH backend (plain "
            "softmax(QKᵀ)V, which builds the whole score matrix) against its FLASH backend (a "
            "fused kernel that never does), batch 1, 8 heads of 32, causal, forward. tiled is "
            "octlm's own tiled attention in plain PyTorch; the sketch is the first blocking of "
            "the computation it grew from (lab/bench/sketch.py).",
            "",
            *(baseline.section(rows) if rows else [filled_by("baseline"), ""]),
        ],
    )
    lines += section(
        "Time ratios within a round",
        [
            "A round measures every backend of a shape one after another, each in a fresh "
            "process, so a ratio within a round compares runs made under the same load.",
            "",
            *rounds.section(found),
        ]
        if found.rounds
        else [filled_by("baseline"), ""],
    )
    lines += section(
        "Equivalence: each attention against a float64 reference (`octlm verify`)",
        equivalence.section(found.verify) if found.verify else [filled_by("verify"), ""],
    )
    lines += section(
        "Structure tiled can skip: tiled against SDPA given a dense mask",
        structure.section(rows) if structure.measured(rows) else [filled_by("structure"), ""],
    )
    lines += section(
        '`attention="auto"` against the faster of FLASH and tiled', route.section(found)
    )
    lines += section(
        "Ring attention: one sequence split over several processes",
        ring.section(found.ring) if found.ring else [filled_by("ring"), ""],
    )
    lines += section(
        "Training steps with each attention",
        train_steps.section(found.train_attention)
        if found.train_attention
        else [filled_by("training"), ""],
    )
    if rows:
        names = plot(rows, output.parent, prefix)
        lines += section("Plots", [*(f"![{name}]({name})" for name in names), ""])
        lines += section(
            "Every measurement without window, padding or cache", measurements.section(rows)
        )
    return lines


def _describe(found: Collected) -> str:
    """The machine of ``found``'s records, in one line."""
    some = next(iter([*found.rounds.values(), *found.peaks, *found.verify, *found.ring]), {})
    some = some or next(iter(found.train_attention), {})
    return records.describe_machine(some)


def _sources(found: Collected, machines: list[Collected]) -> list[str]:
    """Where the records came from, on what machines, what was skipped and what was busy."""
    names = ", ".join(f"`{p}`" for p in found.paths) or "no files"
    if not found.count:
        lines = [f"No records in {names}: nothing was measured, so this report has no figures."]
        lines += [f"- {note}" for note in found.skipped]
        return [*lines, "", filled_by("baseline", "The first to take"), ""]
    rows = found.bench
    lines = [
        f"{found.count} records from {names}: {len(rows)} benchmark measurements, "
        f"{len(found.verify)} verification checks, {len(found.ring)} ring measurements, "
        f"{len(found.train_attention)} training-step measurements.",
        "",
    ]
    lines += [f"- skipped: {note}" for note in found.skipped]
    if len(machines) > 1:
        lines += [
            f"- These records describe {len(machines)} machines differently; each machine is "
            "reported on its own below, and no figure of one is set against another's:"
        ]
        lines += [
            f"  {number}. {_describe(part)} ({part.count} records)"
            for number, part in enumerate(machines, 1)
        ]
    else:
        lines += [f"- Machine: {_describe(machines[0])}"]
    devices = sorted({(r.get("device"), r.get("threads")) for r in rows}, key=str)
    lines += [
        f"- `{device} ×{threads}` in the tables: {device}, {threads} threads"
        for device, threads in devices
    ]
    # --busy's own rounds are busy by design: only a round that was meant to be alone counts.
    alone = [r for r in found.rounds.values() if r["status"] == "ok" and not r.get("busy")]
    flagged = [r for r in alone if busy(r)]
    if flagged:
        lines += [
            f"- {len(flagged)} of {len(alone)} measurements (rounds counted one by one) ran "
            "while other processes shared the CPU, though no competing process was started "
            f"(for example, one {busy(flagged[0])}); they are marked †."
        ]
    return [
        *lines,
        "",
        "Times are medians over the repeats (several rounds: the median of the rounds). Memory "
        "is the extra bytes of the call: peak minus the baseline taken just before it (CPU: "
        "`ru_maxrss`; CUDA: `max_memory_allocated`). " + BUSY_NOTE,
        "",
    ]
