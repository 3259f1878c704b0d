"""Figures that hold on a shared machine: ratios per round, contention, the matmul peak.

A round measures every backend of a shape one after the other, each in a fresh process, so a
ratio taken within one round compares runs made under the same load; the report gives each
ratio's median over the rounds and its spread. With ``octlm bench SUITE --busy`` every point is also
measured beside one CPU-bound competing process, and the growth busy ÷ idle of each backend
says how it holds up under contention. Each run's ``peak`` record (a large float32
``torch.mm``) turns a time into a fraction of what the machine's matrix multiply can do.
"""

from __future__ import annotations

import statistics

from octlm.attention.tiled.options import DEFAULT_BLOCK
from octlm.lab.bench.suites import KEY_FIELDS
from octlm.lab.report.collect import Collected, backend_label, busy, where
from octlm.lab.report.format import BUSY_MARK, filled_by, spread, table

# Contention target: (tiled busy / tiled idle) <= CONTENTION_TARGET * (FLASH busy / FLASH idle).
CONTENTION_TARGET = 1.1


def _names(field: str) -> list[str]:
    """What makes two measurements of one round comparable: where they ran and every field of the
    measurement's key but ``field``; comparing backends, tiled's tile goes with the backend
    (:func:`backend_label`), since the other backends have none."""
    varied = (field, "block") if field == "backend" else (field,)
    return ["device", *(name for name in KEY_FIELDS if name not in varied)]


def by_round(found: Collected, field: str) -> dict[tuple, dict]:
    """``{(the other fields, machine, run, round): {value of field: record}}`` over the ok
    records: each inner dict holds the records of one round of one run that differ only in
    ``field``."""
    names = _names(field)
    rounds: dict[tuple, dict] = {}
    for (machine, key, round), record in found.rounds.items():
        if record["status"] == "ok":
            shape = {"device": where(record), **dict(zip(KEY_FIELDS, key, strict=True))}
            value = backend_label(record) if field == "backend" else shape[field]
            rest = tuple(shape[name] for name in names)
            place = (rest, machine, record.get("run"), round)
            rounds.setdefault(place, {})[value or False] = record
    return rounds


def pairs(found: Collected, field: str, bottom) -> dict[tuple, list[tuple[dict, dict]]]:
    """``{(the other fields, top value): [(top record, bottom record) per round]}``: ok records
    of one round of one run that differ only in ``field``, the bottom one having value
    ``bottom``. Records of different runs never pair, even under one round number."""
    out: dict[tuple, list[tuple[dict, dict]]] = {}
    for (rest, _machine, _run, _round), by in sorted(by_round(found, field).items(), key=str):
        if bottom in by:
            for value, record in by.items():
                if value != bottom:
                    out.setdefault((rest, value), []).append((record, by[bottom]))
    return out


def shape_of(rest: tuple, field: str) -> dict:
    return dict(zip(_names(field), rest, strict=True))


def describe(shape: dict) -> str:
    q_len, length = shape["q_len"] or shape["length"], shape["length"]
    text = (
        f"{shape['mode']} {shape['dtype']} {length:,}"
        if q_len == length
        else (f"{shape['mode']} {shape['dtype']} {q_len:,}×{length:,}")
    )
    text += f", window {shape['window']}" if shape.get("window") else ""
    text += f", padding {shape['padding']:g}" if shape.get("padding") else ""
    if (shape["heads"], shape["kv_heads"], shape["head_size"]) != (8, 8, 32):
        text += f", {shape['heads']}/{shape['kv_heads']} heads of {shape['head_size']}"
    text += f", batch {shape['batch']}" if shape.get("batch", 1) != 1 else ""
    text += ", not causal" if shape.get("causal") is False else ""
    text += f", {shape['feature']}" if shape.get("feature") else ""
    block = shape.get("block")
    text += f", tiles {block[0]}×{block[1]}" if block and tuple(block) != DEFAULT_BLOCK else ""
    return text


def peak_of(found: Collected, record: dict) -> dict | None:
    """The matmul probe of ``record``'s run, under the same load (``busy``), if any."""
    for peak in found.peaks:
        same_load = bool(peak.get("busy")) == bool(record.get("busy"))
        if peak.get("run") == record.get("run") and same_load:
            return peak
    return None


def _of_peak(found: Collected, records: list[dict]) -> str:
    """Median achieved fraction of the run's matmul peak, by FlashAttention's FLOP count;
    marked when a probe ran on a busy machine (then above 100% is possible)."""
    peaks = [(r, peak_of(found, r)) for r in records if r.get("tflops")]
    fractions = [r["tflops"] * 1e3 / peak["gflops"] for r, peak in peaks if peak]
    if not fractions:
        return "—"
    flagged = any(peak and busy(peak) for _, peak in peaks)
    return f"{statistics.median(fractions):.0%}" + (f" {BUSY_MARK}" if flagged else "")


def _flagged(pairs_: list[tuple[dict, dict]]) -> str:
    """How many rounds ran on a busy machine (records from before load was recorded: unknown)."""
    told = [pair for pair in pairs_ if all("load_before" in record for record in pair)]
    if not told:
        return "not recorded"
    count = sum(1 for top, bottom in told if busy(top) or busy(bottom))
    return f"{count} of {len(told)}" if count else "none"


def longest(found_pairs: dict[tuple, list], field: str) -> list[tuple[dict, str, list]]:
    """``(shape, varied value, pairs)`` at the longest length of each series, idle only, in
    a reading order: device, mode, dtype, structure, backend."""
    kept: dict[tuple, tuple[dict, str, list]] = {}
    for (rest, value), pairs_ in found_pairs.items():
        shape = shape_of(rest, field)
        if shape["busy"]:
            continue
        square = shape["q_len"] in (None, shape["length"])
        series = (*(shape[f] for f in _names(field) if f not in ("length", "q_len")), value)
        series += ("square" if square else shape["q_len"],)
        if series not in kept or kept[series][0]["length"] < shape["length"]:
            kept[series] = (shape, value, pairs_)
    return [kept[series] for series in sorted(kept, key=str)]


def section(found: Collected) -> list[str]:
    """Peaks, per-round ratios to FLASH and between dtypes, and the contention table."""
    lines = _peaks(found)
    body = []
    for shape, backend, found_pairs in longest(pairs(found, "backend", "flash"), "backend"):
        ratios = [top["seconds_median"] / bottom["seconds_median"] for top, bottom in found_pairs]
        tops, bottoms = zip(*found_pairs, strict=True)
        body.append(
            [
                f"{shape['device']} {describe(shape)}",
                f"{backend} ÷ FLASH",
                spread(ratios),
                _of_peak(found, list(tops)),
                _of_peak(found, list(bottoms)),
                _flagged(found_pairs),
            ]
        )
    lines += ["### Each backend's time over FLASH's (longest length of each series)", ""]
    if body:
        header = ["Shape", "Ratio", "Median (min–max, rounds)", "% of peak", "FLASH % of peak"]
        lines += table([*header, "Rounds on a busy machine"], body)
    else:
        lines += [filled_by("baseline", "No round measured FLASH beside another backend"), ""]
    lines += _dtypes(found)
    lines += _contention(found)
    return lines


def _peaks(found: Collected) -> list[str]:
    if not found.peaks:
        return ["No matrix-multiply peak was recorded: no time is given as a fraction of it.", ""]
    idle = [p["gflops"] for p in found.peaks if not p.get("busy")]
    size = found.peaks[0].get("size")
    text = f"Matrix-multiply peak (float32 `torch.mm`, {size}², median of each run's calls): "
    parts = []
    if idle:
        parts.append(f"{statistics.median(idle):.0f} GFLOP/s over {len(idle)} run(s)")
    crowded = [p["gflops"] for p in found.peaks if p.get("busy")]
    if crowded:
        parts.append(f"{statistics.median(crowded):.0f} GFLOP/s beside the competing process")
    note = " Fractions of peak below use FlashAttention's FLOP count and the same run's probe;"
    note += " a probe taken on a busy machine is marked † (a fraction can then pass 100%)."
    flagged = [busy(p) for p in found.peaks if busy(p)]
    if flagged:
        note += f" {len(flagged)} of {len(found.peaks)} probe(s) ran busy ({flagged[0]})."
    return [text + "; ".join(parts) + "." + note, ""]


def _dtypes(found: Collected) -> list[str]:
    body = []
    for shape, dtype, found_pairs in longest(pairs(found, "dtype", "float32"), "dtype"):
        ratios = [top["seconds_median"] / bottom["seconds_median"] for top, bottom in found_pairs]
        shown = describe({**shape, "dtype": dtype}).replace(f" {dtype}", "")
        body.append(
            [
                f"{shape['device']} {shape['backend']} {shown}",
                f"{dtype} ÷ float32",
                spread(ratios),
                _flagged(found_pairs),
            ]
        )
    header = ["Backend and shape", "Ratio", "Median (min–max, rounds)", "Rounds on a busy machine"]
    return _titled("Lower precision against float32, within a round (longest length)", header, body)


def _contention(found: Collected) -> list[str]:
    growth = pairs(found, "busy", False)
    body = []
    for (rest, _), tiled in growth.items():
        shape = shape_of(rest, "busy")
        if shape["backend"] != "tiled":
            continue
        flash = growth.get((tuple({**shape, "backend": "flash", "block": None}.values()), True))
        tiled_growth = _growths(tiled)
        cells = [f"{shape['device']} {describe(shape)}", spread(list(tiled_growth.values()))]
        if not flash:
            body.append([*cells, "—", "", ""])
            continue
        flash_growth = _growths(flash)
        rounds = sorted(set(tiled_growth) & set(flash_growth), key=str)
        relative = [tiled_growth[r] / flash_growth[r] for r in rounds]
        if not relative:  # both grew, but never in the same round
            body.append([*cells, spread(list(flash_growth.values())), "—", ""])
            continue
        met = "yes" if statistics.median(relative) <= CONTENTION_TARGET else "no"
        if any(busy(idle) for _, idle in [*tiled, *flash]):
            met = "not judged: the idle runs were on a busy machine"
        body.append([*cells, spread(list(flash_growth.values())), spread(relative), met])
    header = ["Shape", "tiled busy ÷ idle", "FLASH busy ÷ idle", "tiled growth ÷ FLASH growth"]
    return _titled(
        "Under contention (`--busy`: one CPU-bound process beside the measurement)",
        [*header, "Met"],
        body,
        f"Target: tiled's growth at most {CONTENTION_TARGET:g}× FLASH's.",
    )


def _titled(title: str, header: list[str], body: list[list[str]], *notes: str) -> list[str]:
    """A subsection: title, notes, table; nothing at all when the table has no rows."""
    if not body:
        return []
    return [
        f"### {title}",
        "",
        *(line for note in notes for line in (note, "")),
        *table(header, body),
    ]


def _growths(found_pairs: list[tuple[dict, dict]]) -> dict[tuple, float]:
    """busy ÷ idle time, keyed by the run and the round."""
    return {
        (top.get("run"), top.get("round", 1)): top["seconds_median"] / bottom["seconds_median"]
        for top, bottom in found_pairs
    }
