"""A training run's metrics (``train_step`` and ``eval`` records), as a small table per run.

The report reads what a training run writes (``RUN_DIR/metrics.jsonl``) when that file is
among its inputs; it needs nothing from the training code.
"""

from __future__ import annotations

import statistics

from octlm.report.format import NOT_MEASURED, table

# Rows shown per run: the evaluations, and train steps spread evenly up to this many.
STEP_ROWS = 8


def section(found: list[dict]) -> list[str]:
    """Per run (file and run id): steps sampled evenly, every evaluation, tokens per second."""
    if not found:
        return [NOT_MEASURED, ""]
    runs: dict[tuple, list[dict]] = {}
    for record in found:
        runs.setdefault((record["source"], record.get("run")), []).append(record)
    lines = []
    for (source, run), group in runs.items():
        steps = {r["step"]: r for r in group if r["kind"] == "train_step"}
        evals = {r["step"]: r for r in group if r["kind"] == "eval"}
        ordered = sorted(steps)
        shown = set(ordered[:: max(1, len(ordered) // STEP_ROWS)]) | set(ordered[-1:]) | set(evals)
        body = [_row(step, steps.get(step, {}), evals.get(step, {})) for step in sorted(shown)]
        speeds = [r["tokens_per_second"] for r in steps.values() if _number(r, "tokens_per_second")]
        speed = f"; median {statistics.median(speeds):,.0f} tokens/s" if speeds else ""
        lines += [f"`{source}`{f' (run {run})' if run else ''}: {len(steps)} steps, "
                  f"{len(evals)} evaluations{speed}.", ""]  # fmt: skip
        header = ["Step", "Loss", "Learning rate", "Grad norm", "Val loss", "Val bits/byte"]
        lines += table(header, body)
    return lines


def _number(record: dict, name: str) -> bool:
    return isinstance(record.get(name), int | float) and not isinstance(record.get(name), bool)


def _row(step: int, train: dict, evaluation: dict) -> list[str]:
    def show(record: dict, name: str, form: str) -> str:
        return format(record[name], form) if _number(record, name) else ""

    return [
        f"{step:,}",
        show(train, "loss", ".4f"),
        show(train, "lr", ".3g"),
        show(train, "grad_norm", ".3g"),
        show(evaluation, "val_loss", ".4f"),
        show(evaluation, "val_bits_per_byte", ".4f"),
    ]
