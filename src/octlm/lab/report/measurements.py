"""Every plain measurement (no window, padding or cache), one table per device, mode, dtype
and shape, with the measurements taken while the machine was busy marked."""

from __future__ import annotations

from octlm.lab.report.collect import backend_label, plain, where
from octlm.lab.report.format import cell, table

PLAIN_SHAPE = ("device", "mode", "dtype", "batch", "heads", "kv_heads", "head_size", "causal")


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Plain records grouped by :data:`PLAIN_SHAPE`."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if plain(r):
            shape = (where(r), *(r.get(name) for name in PLAIN_SHAPE[1:]))  # device: threads too
            groups.setdefault(shape, []).append(r)
    return groups


def section(rows: list[dict]) -> list[str]:
    lines = []
    for shape, group in sorted(_series(rows).items(), key=str):
        device, mode, dtype, batch, heads, kv_heads, head_size, causal = shape
        backends = sorted({backend_label(r) for r in group})
        lengths = sorted({r["length"] for r in group})
        cells = {(r["length"], backend_label(r)): r for r in group}
        lines += [
            f"**{device}, {mode}, {dtype}**: batch {batch}, {heads} heads "
            f"({kv_heads} key/value), head size {head_size}, {'' if causal else 'not '}causal",
            "",
        ]
        lines += table(
            ["length", *backends],
            [[f"{n:,}", *(cell(cells.get((n, b))) for b in backends)] for n in lengths],
        )
    return lines or ["No measurement without window, padding or cache.", ""]
