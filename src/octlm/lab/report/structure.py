"""Structure that tiled attention can skip and a dense mask cannot: sliding window, chunked
prefill after a cache, decoding one token, padded keys, packed documents, left padding; and the
score modifiers and sinks, per tile in tiled and a dense bias for SDPA. Tiled against SDPA given
the mask."""

from __future__ import annotations

from octlm.lab.report.collect import backend_label, where
from octlm.lab.report.format import cell, filled_by, is_ok, ratio, table

# The targets: (ratio, its bound or None for none, True when the ratio must be at least the
# bound), set for TARGET_KEYS keys: at other lengths the ratio is shown but not judged.
TARGET_KEYS = 8192
TARGETS = {
    "window, forward": ("speed-up", 3.0, True),
    "window, train": ("speed-up", 2.0, True),
    "prefill": ("slowdown", 1.0, False),
    "decode": ("slowdown", 1.5, False),
    "padding": ("speed-up", 1.5, True),
    "documents, forward": ("speed-up", 5.0, True),
    "documents, train": ("speed-up", 3.0, True),
    "left padding": ("speed-up", 1.5, True),
    **{
        f"{feature}, {mode}": ("speed-up", None, True)
        for feature in ("softcap", "alibi", "sinks")
        for mode in ("forward", "train")
    },
}


def case_of(record: dict) -> str | None:
    """Which structure case of :data:`TARGETS` a record measures, if any."""
    window, padding = record.get("window"), record.get("padding")
    length = record["length"]
    q_len = record.get("q_len", length)
    feature = record.get("feature")
    if feature:  # a feature's own case: as many queries as keys, no window
        if window or q_len != length:
            return None
        return "left padding" if feature == "left padding" else f"{feature}, {record['mode']}"
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
# The rest of a measurement's shape: shown when it is not the structure suite's own.
OTHER_SHAPE = {"batch": 1, "heads": 8, "kv_heads": 8, "head_size": 32, "causal": True}


def section(rows: list[dict]) -> list[str]:
    groups: dict[str, dict[tuple, dict[str, dict]]] = {case: {} for case in TARGETS}
    for r in rows:
        case = case_of(r)
        if case in groups:
            shape = (where(r), *(r.get(name) for name in (*STRUCTURE_SHAPE[1:], *OTHER_SHAPE)))
            groups[case].setdefault(shape, {})[backend_label(r)] = r
    body = []
    for case, (ratio_name, target, at_least) in TARGETS.items():
        wanted = "" if target is None else f"{ratio_name} {'≥' if at_least else '≤'} {target:g}×"
        wanted += f" at {TARGET_KEYS:,} keys" if wanted else ""
        for shape, by in sorted(groups[case].items(), key=str):
            device, mode, dtype, q_len, length, window, padding = shape[: len(STRUCTURE_SHAPE)]
            queries = "1 query" if q_len == 1 else f"{q_len:,} queries"
            described = f"{device} {dtype} {mode}, {queries} × {length:,} keys"
            described += f", window {window}" if window else ""
            described += f", padding {padding:g}" if padding else ""
            other = dict(zip(OTHER_SHAPE, shape[len(STRUCTURE_SHAPE) :], strict=True))
            described += "".join(
                f", {name} {value}" for name, value in other.items() if value != OTHER_SHAPE[name]
            )
            cells = [cell(by.get(name)) for name in ("tiled", "flash", "math")]
            tiled, flash = by.get("tiled"), by.get("flash")
            shown, met = "", ""
            if is_ok(tiled) and is_ok(flash):
                value = flash["seconds_median"] / tiled["seconds_median"]
                if ratio_name == "slowdown":
                    value = 1 / value
                shown = f"{ratio_name} {ratio(value)}"
                if target is not None and length == TARGET_KEYS:
                    met = "yes" if (value >= target if at_least else value <= target) else "no"
            body.append([case, described, *cells, shown, wanted, met])
    header = ["Case", "Shape", "tiled", "FLASH (dense mask)", "MATH", "Ratio", "Target", "Met"]
    missing = [case for case in TARGETS if not groups[case]]
    return [
        "Speed-up is the SDPA FLASH time (dense mask) ÷ the tiled time; slowdown is its "
        "inverse, tiled ÷ FLASH.",
        "",
        *table(header, body),
        *([filled_by("structure", "No records of: " + "; ".join(missing)), ""] if missing else []),
    ]


def measured(rows: list[dict]) -> bool:
    """Whether any of ``rows`` measures a structure case."""
    return any(case_of(r) in TARGETS for r in rows)
