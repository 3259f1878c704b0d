"""Ring attention over W processes against one process at the same total length."""

from __future__ import annotations

from octlm.lab.report.format import MiB, filled_by, mib, seconds, table


def section(found: list[dict]) -> list[str]:
    """Time and memory for the rank that peaked highest: extra over its baseline, and the peak
    itself (the baseline holds the rank's shard of query, key and value, which is what shrinks
    as processes are added)."""
    if not found:
        return [filled_by("ring"), ""]
    body = []
    for r in sorted(found, key=lambda r: (r["mode"], r["length"], r["world_size"])):
        row = [r["mode"], f"{r['length']:,}", str(r["world_size"])]
        if r["status"] != "ok":
            body.append([*row, r["status"], "", ""])
            continue
        peak = f"{r['peak_bytes'] / MiB:,.0f} MiB"
        body.append([*row, seconds(r["seconds_median"]), mib(r), peak])
    header = ["Mode", "Length", "Processes", "Time", "Extra memory", "Peak (its shard included)"]
    return table(header, body)
