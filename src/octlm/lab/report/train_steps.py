"""Tokens per second of ``octlm train`` with each attention (``octlm bench training
--what attention``): one fresh training process per implementation, length, packing, dtype and
round.

Within a round the implementations ran one after the other under the same load, so the table
judges ``auto`` by its time per step over the faster of ``sdpa`` and ``tiled`` in the same
round (the inverse ratio of tokens per second), median and spread over the rounds.
"""

from __future__ import annotations

import statistics

from octlm.lab.report.format import filled_by, spread, table

SHOWN = ("naive", "sdpa", "tiled", "auto")
RIVALS = ("sdpa", "tiled")


def section(found: list[dict]) -> list[str]:
    """A row per (threads, length, batch, packing, dtype); a column per implementation."""
    ok = [r for r in found if r.get("status") == "ok"]
    if not ok:
        return [filled_by("training", "No training step measured ok"), ""]
    rows: dict[tuple, dict] = {}
    for r in ok:
        shape = (r["threads"], r["length"], r["batch"], bool(r.get("packed")), r["dtype"])
        row = rows.setdefault(shape, {"speeds": {}, "rounds": {}})
        row["speeds"].setdefault(r["attention"], []).append(r["tokens_per_second"])
        if "round" in r:
            place = (r.get("run"), r["round"])
            row["rounds"].setdefault(place, {})[r["attention"]] = r["tokens_per_second"]
    body = []
    for (threads, length, batch, packed, dtype), row in sorted(rows.items()):
        cells = [
            f"{statistics.median(row['speeds'][name]):,.0f}" if name in row["speeds"] else "—"
            for name in SHOWN
        ]
        ratios = [
            max(by[name] for name in RIVALS) / by["auto"]
            for by in row["rounds"].values()
            if "auto" in by and all(name in by for name in RIVALS)
        ]
        shape = f"{batch} × {length:,}, {'packed' if packed else 'windows'}, {dtype}"
        body.append([shape, str(threads), *cells, spread(ratios) if ratios else "—"])
    header = ["Batch × tokens, rows, dtype", "Threads", *(f"{n} tok/s" for n in SHOWN)]
    return [
        "Median tokens per second over the runs; the last column is auto's time per step ÷ "
        "the faster of sdpa and tiled in the same round (1 or less: auto is no slower).",
        "",
        *table([*header, "auto ÷ faster, median (min–max, rounds)"], body),
    ]
