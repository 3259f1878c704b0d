"""``octlm report``: the seed's claims beside this machine's figures, tables and plots.

Every number in the report is computed from records (DESIGN §5: benchmark, ring and
verification records); none is typed in, and what the records lack reads "not measured".
Times are medians over the repeats; memory is ``extra_bytes``, the peak minus the baseline
just before the call (interpreter, torch and the inputs are in the baseline).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from octlm import records
from octlm.bench.suites import BACKENDS, key_of

MiB = 2**20
NOT_MEASURED = "not measured"
# The seed's Day 2 benchmark shape, which its claims are about.
SEED_SHAPE = {"batch": 1, "heads": 8, "kv_heads": 8, "head_size": 32, "causal": True}
# In the plots a backend keeps its colour and a dtype its line style.
LINESTYLES = {"float32": "-", "bfloat16": "--", "float16": "-.", "float64": ":"}
FLASH32, TILED32 = dict(backend="flash", dtype="float32"), dict(backend="tiled", dtype="float32")


def load(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Benchmark records of ``paths``, one per measurement and device.

    A measurement recorded twice keeps its latest ``ok`` record, or its latest record when none
    is ok, so a failed rerun never hides a result.
    """
    latest: dict[tuple, dict] = {}
    for path in paths:
        for record in records.read(path):
            if not {"backend", "mode", "length", "status"} <= record.keys():
                continue  # a verification record, or another experiment's
            if "world_size" in record:
                continue  # ring attention over several processes (octlm.bench.ring)
            key = (record.get("device"), key_of(record))
            if key not in latest or record["status"] == "ok" or latest[key]["status"] != "ok":
                latest[key] = record
    return list(latest.values())


def write_report(
    paths: Iterable[str | os.PathLike] | None = None, output: str | os.PathLike = "runs/report.md"
) -> Path:
    """Write ``output`` (Markdown) and its PNG plots beside it; return the Markdown's path.

    ``paths`` defaults to every ``runs/*.jsonl``.
    """
    output = Path(output)
    paths = sorted(Path("runs").glob("*.jsonl")) if paths is None else [Path(p) for p in paths]
    rows = load(paths)
    output.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# octlm benchmark report", ""]
    lines += _machines(rows, paths)
    lines += ["## The seed's claims on this machine", ""]
    lines += _table(["Claim", "Seed (laptop CPU, Day 2)", "Here"], claims(rows))
    lines += ["## Equivalence (`octlm verify`)", ""]
    lines += _equivalence(paths)
    lines += ["## Structure cases (issue 8): tiled against SDPA with a dense mask", ""]
    lines += _structure(rows)
    lines += ["## Context parallel: ring attention over W processes (`octlm.bench.ring`)", ""]
    lines += _ring(paths)
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in plot(rows, output.parent)] or [NOT_MEASURED]
    lines += ["", "## Every measurement without window, padding or cache", ""]
    lines += _all(rows)
    output.write_text("\n".join(lines) + "\n")
    return output


# ---- selecting records ------------------------------------------------------------------


def _plain(record: dict) -> bool:
    """Square causal attention without window or padding: the seed's kind of measurement."""
    return (
        not record.get("window")
        and not record.get("padding")
        and record.get("q_len", record["length"]) == record["length"]
    )


def _seed_rows(rows: list[dict], mode: str = "forward") -> list[dict]:
    """Plain CPU records of the seed's shape, in ``mode``."""
    return [
        r
        for r in rows
        if r.get("device") == "cpu"
        and r["mode"] == mode
        and _plain(r)
        and all(r.get(name) == value for name, value in SEED_SHAPE.items())
    ]


def _ok(rows: list[dict], **want) -> dict[int, dict]:
    """``{length: record}`` of the ok records that match ``want``."""
    return {
        r["length"]: r
        for r in rows
        if r["status"] == "ok" and all(r.get(name) == value for name, value in want.items())
    }


def _common(preferred: int, *series: dict[int, dict]) -> int | None:
    """``preferred`` when every series has it, else the longest length they share."""
    shared = set.intersection(*(set(s) for s in series)) if series else set()
    if preferred in shared:
        return preferred
    return max(shared, default=None)


# ---- formatting -------------------------------------------------------------------------


def _mib(record: dict) -> str:
    return f"{record['extra_bytes'] / MiB:,.0f} MiB"


def _seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _ratio(value: float) -> str:
    return f"{value:.3g}×"


def _growth(small: dict, large: dict) -> float:
    """Factor per doubling of length from ``small`` to ``large`` (geometric mean)."""
    doublings = math.log2(large["length"] / small["length"])
    return (large["extra_bytes"] / max(small["extra_bytes"], 1)) ** (1 / doublings)


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return [*lines, ""]


def _machines(rows: list[dict], paths: list[Path]) -> list[str]:
    names = ", ".join(f"`{p}`" for p in paths) or "no files"
    lines = [
        f"{len(rows)} benchmark measurements (ring and verification records apart) from {names}.",
        "",
    ]
    machines = sorted(
        {(r.get("device"), r.get("host_cpu"), r.get("threads"), r.get("torch")) for r in rows},
        key=str,
    )
    lines += [
        f"- **{device}**: host CPU {cpu}, {threads} threads, torch {torch}"
        for device, cpu, threads, torch in machines
    ] or ["- no benchmark records: every figure below is " + NOT_MEASURED]
    return [
        *lines,
        "",
        "Times are medians over the repeats. Memory is the extra bytes of the call: peak minus "
        "the baseline taken just before it (CPU: `ru_maxrss`; CUDA: `max_memory_allocated`).",
        "",
    ]


# ---- the seed's claims ------------------------------------------------------------------


def claims(rows: list[dict]) -> list[list[str]]:
    """Rows of (claim, the seed's figure, this machine's figure)."""
    forward, train = _seed_rows(rows), _seed_rows(rows, "train")
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
            "not in the seed (a sketch, not timed)",
            _tiled_vs_flash(forward),
        ],
        [
            "tiled against the seed's sketch, forward float32",
            "not timed in the seed",
            _tiled_vs_sketch(forward),
        ],
        [
            "tiled bfloat16 against tiled float32",
            "not in the seed",
            _tiled_bf16(forward),
        ],
        [
            "training time (forward + backward): tiled against FLASH, float32",
            "not in the seed (forward only)",
            _train_time(train),
        ],
        [
            "training at 16,384 tokens",
            "not in the seed",
            _train_long(train),
        ],
        [
            "training memory: tiled against FLASH and MATH",
            "not in the seed (forward only)",
            _train_memory(train),
        ],
    ]


def _math_growth(rows: list[dict]) -> str:
    math_rows = _ok(rows, backend="math", dtype="float32")
    if len(math_rows) < 2:
        return NOT_MEASURED
    small, large = math_rows[min(math_rows)], math_rows[max(math_rows)]
    return (
        f"{_ratio(_growth(small, large))} ({_mib(small)} at {small['length']:,} → "
        f"{_mib(large)} at {large['length']:,})"
    )


def _flash_flat(rows: list[dict]) -> str:
    flash = _ok(rows, backend="flash", dtype="float32")
    if not flash:
        return NOT_MEASURED
    large = flash[_common(8192, flash)]
    text = f"{_mib(large)} at {large['length']:,}"
    if len(flash) > 1:
        text += f" ({_ratio(_growth(flash[min(flash)], large))} per doubling)"
    return text


def _time_ratio(rows: list[dict], top: dict, bottom: dict) -> tuple[float, int] | None:
    """Median time of ``top`` over ``bottom`` (record filters) at 8,192 or the longest shared
    length, and that length; None when they share none."""
    over, under = _ok(rows, **top), _ok(rows, **bottom)
    length = _common(8192, over, under)
    if length is None:
        return None
    return over[length]["seconds_median"] / under[length]["seconds_median"], length


def _speedup(rows: list[dict]) -> str:
    found = _time_ratio(rows, dict(backend="math", dtype="float32"), FLASH32)
    return NOT_MEASURED if found is None else f"{_ratio(found[0])} at {found[1]:,}"


def _bf16(rows: list[dict]) -> str:
    parts = []
    for backend, name in (("math", "MATH"), ("flash", "FLASH")):
        found = _time_ratio(
            rows, dict(backend=backend, dtype="bfloat16"), dict(backend=backend, dtype="float32")
        )
        if found is None:
            parts.append(f"{name} {NOT_MEASURED}")
            continue
        ratio, length = found
        verdict = "slower" if ratio > 1 else "faster"
        parts.append(f"{name}: {_ratio(ratio)} the float32 time at {length:,} ({verdict})")
    return "; ".join(parts)


def _efficient(rows: list[dict]) -> str:
    tried = [r for r in rows if r.get("device") == "cpu" and r["backend"] == "efficient"]
    if not tried:
        return NOT_MEASURED
    unsupported = [r for r in tried if r["status"] == "unsupported"]
    if len(unsupported) == len(tried):
        return f"unsupported in all {len(tried)} measurements: {unsupported[0].get('reason')}"
    return f"ran: {len(tried) - len(unsupported)} of {len(tried)} measurements ok"


def _tiled_vs_flash(rows: list[dict]) -> str:
    tiled = _ok(rows, backend="tiled", dtype="float32")
    flash = _ok(rows, backend="flash", dtype="float32")
    length = _common(8192, tiled, flash)
    if length is None:
        return NOT_MEASURED
    t, f = tiled[length], flash[length]
    return (
        f"time {_ratio(t['seconds_median'] / f['seconds_median'])} FLASH, extra memory "
        f"{_mib(t)} vs {_mib(f)} ({_ratio(t['extra_bytes'] / max(f['extra_bytes'], 1))}) "
        f"at {length:,}"
    )


def _tiled_vs_sketch(rows: list[dict]) -> str:
    found = _time_ratio(rows, dict(backend="sketch", dtype="float32"), TILED32)
    return NOT_MEASURED if found is None else f"{_ratio(found[0])} faster at {found[1]:,}"


def _tiled_bf16(rows: list[dict]) -> str:
    found = _time_ratio(rows, dict(backend="tiled", dtype="bfloat16"), TILED32)
    return NOT_MEASURED if found is None else f"{_ratio(found[0])} the float32 time at {found[1]:,}"


def _train_time(rows: list[dict]) -> str:
    found = _time_ratio(rows, TILED32, FLASH32)
    return NOT_MEASURED if found is None else f"{_ratio(found[0])} FLASH's time at {found[1]:,}"


def _train_long(rows: list[dict]) -> str:
    parts = []
    for backend in ("tiled", "flash", "math"):
        found = [r for r in rows if r["backend"] == backend and r["length"] == 16384]
        if not found:
            parts.append(f"{backend} {NOT_MEASURED}")
        elif found[0]["status"] == "ok":
            parts.append(f"{backend} {_seconds(found[0]['seconds_median'])}, {_mib(found[0])}")
        else:
            parts.append(f"{backend} {found[0]['status']} ({found[0].get('reason')})")
    return "; ".join(parts)


def _train_memory(rows: list[dict]) -> str:
    tiled = _ok(rows, backend="tiled", dtype="float32")
    parts = []
    for backend, name in (("flash", "FLASH"), ("math", "MATH")):
        other = _ok(rows, backend=backend, dtype="float32")
        length = _common(8192, tiled, other)
        if length is None:
            parts.append(f"vs {name} {NOT_MEASURED}")
            continue
        t, o = tiled[length], other[length]
        parts.append(
            f"tiled {_mib(t)} vs {name} {_mib(o)} "
            f"({_ratio(t['extra_bytes'] / max(o['extra_bytes'], 1))}) at {length:,}"
        )
    return "; ".join(parts)


# ---- equivalence and ring ----------------------------------------------------------------


def _equivalence(paths: list[Path]) -> list[str]:
    """The seed's two equivalence figures beside this machine's, from verification records."""
    checks = [r for p in paths for r in records.read(p) if "check" in r and "error" in r]
    if not checks:
        return [NOT_MEASURED, ""]

    def worst(field: str, **want) -> str:
        found = [r for r in checks if all(r.get(k) == v for k, v in want.items())]
        if not found:
            return NOT_MEASURED
        passed = sum(r["passed"] for r in found)
        return f"{max(r[field] for r in found):.2g} ({passed}/{len(found)} pass)"

    body = [
        [
            "tiled vs SDPA, float32, lengths 128-1,024, blocks 64-256",
            "4.8e-7",
            worst("max_abs_diff", experiment="tiled-sdpa", left="tiled", dtype="float32"),
        ],
        [
            "tiled vs float64 reference (same cases)",
            "not in the seed",
            worst("error", experiment="tiled-sdpa", left="tiled", dtype="float32"),
        ],
        [
            "SDPA vs float64 reference (same lengths)",
            "not in the seed",
            worst("error", experiment="tiled-sdpa", left="sdpa", dtype="float32"),
        ],
        [
            "whole model, SDPA vs naive logits, 8/4/2/1 KV heads",
            "1.1e-6",
            worst("max_abs_diff", check="model logits", left="sdpa", dtype="float32"),
        ],
        [
            "whole model, tiled vs naive logits, 8/4/2/1 KV heads",
            "not in the seed",
            worst("max_abs_diff", check="model logits", left="tiled", dtype="float32"),
        ],
    ]
    failed = sum(not r["passed"] for r in checks)
    return [
        f"{len(checks)} verification records, {failed} failed. Figures are the worst case; "
        "the pass count applies DESIGN §4 (error against float64 within twice naive's).",
        "",
        *_table(["Check", "Seed", "Here"], body),
    ]


def _ring(paths: list[Path]) -> list[str]:
    """Time and memory of ring attention against one process, for the rank that peaked
    highest: extra over its baseline, and the peak itself (the baseline holds the rank's shard
    of query, key and value, which is what shrinks as processes are added)."""
    found = [r for p in paths for r in records.read(p) if "world_size" in r and "status" in r]
    if not found:
        return [NOT_MEASURED, ""]
    body = []
    for r in sorted(found, key=lambda r: (r["mode"], r["length"], r["world_size"])):
        if r["status"] != "ok":
            body.append([r["mode"], f"{r['length']:,}", str(r["world_size"]), r["status"], "", ""])
            continue
        peak = f"{r['peak_bytes'] / MiB:,.0f} MiB"
        row = [r["mode"], f"{r['length']:,}", str(r["world_size"]), _seconds(r["seconds_median"])]
        body.append([*row, _mib(r), peak])
    header = ["Mode", "Length", "Processes", "Time", "Extra memory", "Peak (its shard included)"]
    return [*_table(header, body)]


# ---- structure cases --------------------------------------------------------------------


# The targets: (ratio, its bound, True when the ratio must be at least the bound).
TARGETS = {
    "window, forward": ("speed-up", 3.0, True),
    "window, train": ("speed-up", 2.0, True),
    "prefill": ("slowdown", 1.0, False),
    "decode": ("slowdown", 1.5, False),
    "padding": ("speed-up", 1.5, True),
}


def _case(record: dict) -> str | None:
    """Which structure case of :data:`TARGETS` a record measures, if any."""
    window, padding = record.get("window"), record.get("padding")
    length = record["length"]
    q_len = record.get("q_len", length)
    if window and not padding and q_len == length:
        return f"window, {record['mode']}"
    if padding and not window and q_len == length:
        return "padding"
    if not window and not padding and q_len == 1:
        return "decode"
    if not window and not padding and 1 < q_len < length:
        return "prefill"
    return None


STRUCTURE_SHAPE = ("device", "mode", "dtype", "q_len", "length", "window", "padding")


def _structure(rows: list[dict]) -> list[str]:
    groups: dict[str, dict[tuple, dict[str, dict]]] = {case: {} for case in TARGETS}
    for r in rows:
        case = _case(r)
        if case in groups:
            shape = tuple(r.get(name) for name in STRUCTURE_SHAPE)
            groups[case].setdefault(shape, {})[r["backend"]] = r
    body = []
    for case, (ratio_name, target, at_least) in TARGETS.items():
        wanted = f"{ratio_name} {'≥' if at_least else '≤'} {target:g}×"
        if not groups[case]:
            body.append([case, NOT_MEASURED, "", "", "", "", wanted, ""])
        for shape, by in sorted(groups[case].items(), key=str):
            device, mode, dtype, q_len, length, window, padding = shape
            queries = "1 query" if q_len == 1 else f"{q_len:,} queries"
            where = f"{device} {dtype} {mode}, {queries} × {length:,} keys"
            where += f", window {window}" if window else ""
            where += f", padding {padding:g}" if padding else ""
            cells = [_cell(by.get(name)) for name in ("tiled", "flash", "math")]
            tiled, flash = by.get("tiled"), by.get("flash")
            ratio, met = "", ""
            if _is_ok(tiled) and _is_ok(flash):
                value = flash["seconds_median"] / tiled["seconds_median"]
                if ratio_name == "slowdown":
                    value = 1 / value
                ratio = f"{ratio_name} {_ratio(value)}"
                met = "yes" if (value >= target if at_least else value <= target) else "no"
            body.append([case, where, *cells, ratio, wanted, met])
    header = ["Case", "Shape", "tiled", "FLASH (dense mask)", "MATH", "Ratio", "Target", "Met"]
    return [
        "Speed-up is the SDPA FLASH time (dense mask) ÷ the tiled time; slowdown is its "
        "inverse, tiled ÷ FLASH.",
        "",
        *_table(header, body),
    ]


def _is_ok(record: dict | None) -> bool:
    return record is not None and record["status"] == "ok"


def _cell(record: dict | None) -> str:
    """``time, memory`` of an ok record; its status otherwise."""
    if record is None:
        return NOT_MEASURED
    if record["status"] != "ok":
        return record["status"]
    text = f"{_seconds(record['seconds_median'])}, {_mib(record)}"
    if record.get("device") != "cpu" and record.get("tflops"):
        text += f", {record['tflops']:.3g} TFLOP/s"
    return text


# ---- every plain measurement ------------------------------------------------------------


PLAIN_SHAPE = ("device", "mode", "dtype", "batch", "heads", "kv_heads", "head_size", "causal")


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Plain records grouped by :data:`PLAIN_SHAPE`."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if _plain(r):
            shape = tuple(r.get(name) for name in PLAIN_SHAPE)
            groups.setdefault(shape, []).append(r)
    return groups


def _all(rows: list[dict]) -> list[str]:
    lines = []
    for shape, group in sorted(_series(rows).items(), key=str):
        device, mode, dtype, batch, heads, kv_heads, head_size, causal = shape
        backends = sorted({r["backend"] for r in group})
        lengths = sorted({r["length"] for r in group})
        cells = {(r["length"], r["backend"]): r for r in group}
        lines += [
            f"**{device}, {mode}, {dtype}**: batch {batch}, {heads} heads "
            f"({kv_heads} key/value), head size {head_size}, {'' if causal else 'not '}causal",
            "",
        ]
        lines += _table(
            ["length", *backends],
            [[f"{n:,}", *(_cell(cells.get((n, b))) for b in backends)] for n in lengths],
        )
    return lines or [NOT_MEASURED]


def plot(rows: list[dict], folder: str | os.PathLike) -> list[str]:
    """Log-log time and extra memory against length, one figure per device, mode and metric.

    One line per backend and dtype (and head size where several). Returns the file names.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in rows:
        if _plain(r) and r["status"] == "ok":
            line = (r["backend"], r["dtype"], r.get("head_size"))
            figures.setdefault((r.get("device"), r["mode"]), {}).setdefault(line, []).append(r)
    names = []
    for (device, mode), lines in sorted(figures.items(), key=str):
        several_sizes = len({size for *_, size in lines}) > 1
        for metric, field, unit, axis in (
            ("time", "seconds_median", 1, "median seconds"),
            ("memory", "extra_bytes", MiB, "extra MiB (peak - baseline)"),
        ):
            figure, ax = plt.subplots(figsize=(6.4, 4.4))
            for (backend, dtype, size), points in sorted(lines.items(), key=str):
                points = sorted(
                    (p for p in points if (p.get(field) or 0) > 0), key=lambda p: p["length"]
                )
                label = f"{backend} {dtype}" + (f", D={size}" if several_sizes else "")
                ax.plot(
                    [p["length"] for p in points],
                    [p[field] / unit for p in points],
                    marker="o",
                    label=label,
                    color=f"C{BACKENDS.index(backend) if backend in BACKENDS else 9}",
                    linestyle=LINESTYLES.get(dtype, ":"),
                )
            ticks = sorted({p["length"] for points in lines.values() for p in points})
            ax.set(xscale="log", yscale="log", xlabel="length (tokens)", ylabel=axis)
            ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
            ax.minorticks_off()
            ax.set_title(f"{mode}: {metric} on {device}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
            slug = "".join(c if c.isalnum() else "-" for c in str(device).lower())
            name = f"bench-{slug}-{mode}-{metric}.png"
            figure.tight_layout()
            figure.savefig(Path(folder) / name, dpi=120)
            plt.close(figure)
            names.append(name)
    return names
