"""``attention="auto"`` against the faster of the two paths it chooses from, round by round.

``octlm bench route`` measures ``auto``, SDPA's FLASH and tiled on each case of the rule
(:func:`octlm.attention.route`), one after the other in fresh processes, round after round.
Within a round, ``auto``'s time over the faster of the other two is what the choice costs:
above 1 where ``auto`` is slower than the path it should have taken (or than its own choice,
by the routing's own overhead). The table gives its median over the rounds and the spread,
with the path ``auto`` took and why.
"""

from __future__ import annotations

import statistics

from octlm.lab.report.collect import Collected
from octlm.lab.report.format import filled_by, spread, table
from octlm.lab.report.rounds import by_round, describe, shape_of
from octlm.lab.report.structure import case_of

# Goal: auto's time at most this multiple of the faster of FLASH and tiled, in the median.
TARGET = 1.05
RIVALS = ("flash", "tiled")


def section(found: Collected) -> list[str]:
    """The route table: case, shape, auto's path and reason, the faster rival, auto ÷ best."""
    series: dict[tuple, dict] = {}
    for (rest, _machine, _run, _round), by in by_round(found, "backend").items():
        shape = shape_of(rest, "backend")
        rivals = {name: by[name] for name in RIVALS if name in by}
        if "auto" not in by or len(rivals) < len(RIVALS) or shape["busy"]:
            continue
        faster = min(rivals, key=lambda name: rivals[name]["seconds_median"])
        entry = series.setdefault(rest, {"shape": shape, "ratios": [], "faster": [], "why": {}})
        entry["ratios"].append(by["auto"]["seconds_median"] / rivals[faster]["seconds_median"])
        entry["faster"].append(faster)
        reason = by["auto"].get("route", "not recorded")
        entry["why"][reason] = entry["why"].get(reason, 0) + 1
    if not series:
        return [filled_by("route", "No round measured auto beside FLASH and tiled"), ""]
    body = []
    for entry in sorted(series.values(), key=lambda e: _order(e["shape"])):
        shape, ratios = entry["shape"], entry["ratios"]
        faster = max(sorted(set(entry["faster"])), key=entry["faster"].count)  # a tie: by name
        wins = f"{entry['faster'].count(faster)} of {len(ratios)}"
        reason = max(entry["why"], key=entry["why"].get)
        chose, _, why = reason.partition(": ")
        met = "yes" if statistics.median(ratios) <= TARGET else "no"
        body.append(
            [
                _case(shape),
                f"{shape['device']} {describe(shape)}",
                chose,
                why,
                f"{'FLASH' if faster == 'flash' else faster} ({wins} rounds)",
                spread(ratios),
                met,
            ]
        )
    header = ["Case", "Shape", "auto ran", "Why", "Faster of FLASH and tiled"]
    return [
        "`auto` ÷ the faster of SDPA FLASH and tiled, within each round (FLASH given the dense "
        f"mask or bias a case needs); goal ≤ {TARGET:g}× in the median.",
        "",
        *table([*header, "auto ÷ faster, median (min–max, rounds)", "Met"], body),
    ]


def _case(shape: dict) -> str:
    q_len = shape["q_len"] or shape["length"]
    plain = not (shape.get("window") or shape.get("padding") or shape.get("feature"))
    if plain and q_len == shape["length"]:
        return f"plain {'causal' if shape['causal'] else 'non-causal'}, {shape['mode']}"
    return case_of({**shape, "q_len": q_len}) or "other"


def _order(shape: dict) -> tuple:
    """Plain first, then the structure cases; forward before train."""
    case = _case(shape)
    return (not case.startswith("plain"), case, shape["mode"] != "forward")
