"""Log-log plots of time and extra memory against length, from plain records."""

from __future__ import annotations

import os
from pathlib import Path

from octlm.lab.bench.suites import BACKENDS
from octlm.lab.report.collect import backend_label, plain
from octlm.lab.report.format import MiB

# A backend keeps its colour, a dtype its line style and a shape its marker.
LINESTYLES = {"float32": "-", "bfloat16": "--", "float16": "-.", "float64": ":"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# What besides backend and dtype makes two points one line: never two shapes joined.
LINE_SHAPE = ("batch", "heads", "kv_heads", "head_size", "causal", "threads")


def _shape_label(shape: tuple) -> str:
    batch, heads, kv_heads, head_size, causal, threads = shape
    text = f", B={batch} H={heads}/{kv_heads} D={head_size}"
    return text + ("" if causal else " full") + (f", {threads} threads" if threads else "")


def plot(rows: list[dict], folder: str | os.PathLike, prefix: str = "") -> list[str]:
    """Log-log time and extra memory against length, one figure per device, mode and metric.

    One line per backend, dtype and shape (batch, heads, head size, causal, threads; named in
    the legend where the figure has several). Returns the file names, each led by ``prefix``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[tuple, dict[tuple, list[dict]]] = {}
    for r in rows:
        if plain(r) and r["status"] == "ok":
            shape = tuple(r.get(name) for name in LINE_SHAPE)
            line = (backend_label(r), r["dtype"], shape)
            figures.setdefault((r.get("device"), r["mode"]), {}).setdefault(line, []).append(r)
    names = []
    for (device, mode), lines in sorted(figures.items(), key=str):
        shapes = sorted({shape for *_, shape in lines}, key=str)  # one marker each
        for metric, field, unit, axis in (
            ("time", "seconds_median", 1, "median seconds"),
            ("memory", "extra_bytes", MiB, "extra MiB (peak - baseline)"),
        ):
            figure, ax = plt.subplots(figsize=(6.4, 4.4))
            for (backend, dtype, shape), points in sorted(lines.items(), key=str):
                points = sorted(
                    (p for p in points if (p.get(field) or 0) > 0), key=lambda p: p["length"]
                )
                label = f"{backend} {dtype}" + (_shape_label(shape) if len(shapes) > 1 else "")
                ax.plot(
                    [p["length"] for p in points],
                    [p[field] / unit for p in points],
                    marker=MARKERS[shapes.index(shape) % len(MARKERS)],
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
            name = f"{prefix}bench-{slug}-{mode}-{metric}.png"
            figure.tight_layout()
            figure.savefig(Path(folder) / name, dpi=120)
            plt.close(figure)
            names.append(name)
    return names
