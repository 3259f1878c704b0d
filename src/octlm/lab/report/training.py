"""The report of a training run: ``octlm report RUN`` (its folder, or its metrics.jsonl).

Reads what ``octlm train`` writes (``RUN/metrics.jsonl``: ``train_step`` and ``eval``
records, one run id per launch; ``RUN/config.json``), and judges a rise of validation by the
training loop's own rule (:func:`octlm.training.metrics.risen`). Per run: the real step count
(the last step recorded, not the number of records: the run logs every ``log_every`` steps),
training time, tokens per second, held-out bits per byte over steps and seconds, whether
validation has risen, the loss curve, and the configuration.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from octlm.lab.report.format import seconds, table
from octlm.training.metrics import RISE, risen_line

METRICS = "metrics.jsonl"
CONFIG = "config.json"
# Training steps shown in the loss table: spread evenly, the last one always among them.
STEP_ROWS = 10
LOG2 = math.log(2)


def metrics_of(folder: str | os.PathLike) -> Path:
    """The metrics file of run folder ``folder``; ``FileNotFoundError`` if it has none."""
    path = Path(folder) / METRICS
    if not path.is_file():
        raise FileNotFoundError(
            f"no records file {str(path)!r}: {str(folder)!r} is no training run's folder"
        )
    return path


def report(found: list[dict], output: Path) -> list[str]:
    """The Markdown lines of the report of the runs in ``found`` (``train_step`` and ``eval``
    records, each with its ``source`` file); plots go beside ``output``."""
    runs: dict[str, list[dict]] = {}
    for record in found:
        runs.setdefault(record["source"], []).append(record)
    lines = ["# octlm training report", ""]
    for number, (source, group) in enumerate(runs.items(), 1):
        lines += _run(Path(source), group, output, number if len(runs) > 1 else None)
    return lines


def _run(source: Path, group: list[dict], output: Path, number: int | None) -> list[str]:
    folder = source.parent
    steps = sorted((r for r in group if r["kind"] == "train_step"), key=lambda r: r["step"])
    evals = sorted((r for r in group if r["kind"] == "eval"), key=lambda r: r["step"])
    last = max((r["step"] for r in group), default=0)
    spent = max((r["train_seconds"] for r in group if _number(r, "train_seconds")), default=None)
    speeds = [r["tokens_per_second"] for r in steps if _number(r, "tokens_per_second")]
    launches = len({r.get("run") for r in group})
    summary = f"{last:,} steps"
    summary += f" in {seconds(spent)} of training" if spent is not None else ""
    summary += f", {launches} launches (resumed)" if launches > 1 else ""
    summary += f"; median {statistics.median(speeds):,.0f} tokens/s" if speeds else ""
    shares = [r["mfu"] for r in steps if _number(r, "mfu")]
    summary += (
        f", {100 * statistics.median(shares):.1f}% of the machines' peak (MFU)" if shares else ""
    )
    if evals and _number(evals[-1], "val_bits_per_byte"):
        final = evals[-1]
        summary += (
            f"; held-out {final['val_bits_per_byte']:.4f} bits per byte at step {final['step']:,}"
        )
    first = group[0]
    machine = f"{first.get('device')}, {first.get('threads')} threads, {first.get('host_cpu')}"
    lines = [f"## Run `{folder}`", "", summary + ".", "", f"Machine: {machine}.", ""]
    slug = "".join(c if c.isalnum() else "-" for c in folder.name) or "run"
    picture = f"loss-{number}-{slug}.png" if number else f"loss-{slug}.png"
    if _plot(steps, evals, output.parent / picture, folder.name):
        lines += ["### Loss curve", "", f"![{picture}]({picture})", ""]
    lines += ["### Held-out bits per byte", ""]
    if evals:
        body = [
            [
                f"{r['step']:,}",
                _show(r, "train_seconds", ".0f"),
                _show(r, "val_loss", ".4f"),
                _show(r, "val_bits_per_byte", ".4f"),
            ]
            for r in evals
        ]
        lines += table(["Step", "Training seconds", "Val loss (nats/token)", "Bits/byte"], body)
        count = _early_stop(folder / CONFIG) or RISE
        said = risen_line(evals, count)
        if said:
            lines += [f"{said[0].upper()}{said[1:]}, or --early-stop {count}.", ""]
    else:
        lines += ["The run recorded no evaluation.", ""]
    lines += ["### Training steps (a sample of the logged steps)", ""]
    shown = steps[:: max(1, math.ceil(len(steps) / STEP_ROWS))]
    shown += [r for r in steps[-1:] if r not in shown]
    body = [
        [
            f"{r['step']:,}",
            _show(r, "train_seconds", ".0f"),
            _show(r, "loss", ".4f"),
            _show(r, "lr", ".3g"),
            _show(r, "grad_norm", ".3g"),
            _show(r, "tokens_per_second", ",.0f"),
            f"{100 * r['mfu']:.1f}%" if _number(r, "mfu") else "",
        ]
        for r in shown
    ]
    header = ["Step", "Training seconds", "Loss (nats/token)", "Learning rate", "Grad norm"]
    lines += table([*header, "Tokens/s", "MFU"], body)
    lines += ["### Configuration", "", *_config(folder / CONFIG)]
    return lines


def _early_stop(path: Path) -> int | None:
    """The run's ``--early-stop`` from its config.json (None: unset or unreadable)."""
    try:
        value = json.loads(path.read_text())["run"].get("early_stop")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _config(path: Path) -> list[str]:
    """The run's config.json as a table of its settings (unset ones left out)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return [f"No readable {CONFIG} beside the metrics.", ""]
    body = [
        [f"{part}.{name}", f"`{json.dumps(value)}`"]
        for part, settings in config.items()
        if isinstance(settings, dict)
        for name, value in settings.items()
        if value is not None
    ]
    return table(["Setting", "Value"], body)


def _plot(steps: list[dict], evals: list[dict], path: Path, title: str) -> bool:
    """Loss in bits per byte against step (training and held-out) and held-out against
    training seconds; False when there is nothing to draw."""
    if not steps and not evals:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4.0), dpi=120)
    # Records written before bits_per_byte existed are of byte tokens: loss / log 2 is that.
    train = [r.get("bits_per_byte", r["loss"] / LOG2) for r in steps]
    by_step.plot([r["step"] for r in steps], train, label="training")
    held = [r for r in evals if _number(r, "val_bits_per_byte")]
    by_step.plot(
        [r["step"] for r in held], [r["val_bits_per_byte"] for r in held], "o-", label="held-out"
    )
    by_step.set(xlabel="optimizer step", ylabel="bits per byte", title=f"{title}: by step")
    timed = [r for r in held if _number(r, "train_seconds")]
    by_time.plot([r["train_seconds"] for r in timed], [r["val_bits_per_byte"] for r in timed], "o-")
    by_time.set(xlabel="training seconds", ylabel="held-out bits per byte", title="by time")
    for axes in (by_step, by_time):
        axes.grid(alpha=0.3)
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def _number(record: dict, name: str) -> bool:
    value = record.get(name)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(record: dict, name: str, form: str) -> str:
    return format(record[name], form) if _number(record, name) else ""
