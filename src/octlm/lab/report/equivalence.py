"""The baseline's two equivalence figures beside this machine's, from ``octlm verify``."""

from __future__ import annotations

from octlm.lab.report.format import filled_by, table

# (check, the baseline's figure, the record field whose worst value is shown, which records).
ROWS = (
    (
        "tiled vs SDPA, float32, lengths 128-1,024, blocks 64-256",
        "4.8e-7",
        "max_abs_diff",
        dict(experiment="tiled-sdpa", left="tiled"),
    ),
    (
        "tiled vs float64 reference (same cases)",
        "none",
        "error",
        dict(experiment="tiled-sdpa", left="tiled"),
    ),
    (
        "SDPA vs float64 reference (same lengths)",
        "none",
        "error",
        dict(experiment="tiled-sdpa", left="sdpa"),
    ),
    (
        "whole model, SDPA vs naive logits, 8/4/2/1 KV heads",
        "1.1e-6",
        "max_abs_diff",
        dict(check="model logits", left="sdpa"),
    ),
    (
        "whole model, tiled vs naive logits, 8/4/2/1 KV heads",
        "none",
        "max_abs_diff",
        dict(check="model logits", left="tiled"),
    ),
)


def section(checks: list[dict]) -> list[str]:
    """Worst figures of each experiment's latest run, with how many checks passed."""
    if not checks:
        return [filled_by("verify"), ""]

    def worst(field: str, **want) -> str:
        found = [r for r in checks if all(r.get(k) == v for k, v in want.items())]
        found = [r for r in found if isinstance(r.get(field), int | float)]
        if not found:
            return "no records"
        passed = sum(r["passed"] for r in found)
        return f"{max(r[field] for r in found):.2g} ({passed}/{len(found)} pass)"

    body = [
        [check, note, worst(field, dtype="float32", **want)] for check, note, field, want in ROWS
    ]
    failed = sum(not r["passed"] for r in checks)
    runs = len({(r["experiment"], r.get("run")) for r in checks})
    return [
        f"{len(checks)} verification records from the latest run of each of {runs} "
        f"experiments, {failed} failed. Figures are the worst case; the pass count applies "
        "the equality rule (docs/design.md, 'When are two results equal': error against float64 "
        "within twice naive's).",
        "",
        *table(["Check", "Baseline", "This machine"], body),
    ]
