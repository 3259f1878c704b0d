"""A run's records (``RUN_DIR/metrics.jsonl``) and its loss-curve picture.

One JSON object per line, appended and fsynced as it is written (docs/design.md, 'Records'), with
the context fields and the ``run`` id every octlm record carries (one id per launch: a resumed run
writes under a new one). A diverged run's losses are NaN or infinite and are kept as such. Lines are
of two kinds:

- ``"kind": "train_step"``: ``step`` (optimizer steps done), ``loss`` (that step's, over the
  whole global batch, in nats per token), ``bits_per_byte`` (the same loss over the bytes its
  targets stand for), ``lr``, ``grad_norm``, ``tokens_per_second`` (since the last record),
  ``model_flops_per_second`` (those tokens' FLOPs, :mod:`octlm.training.utilisation`) and
  ``mfu`` (their share of the machines' peak; absent where no peak was measured),
  ``train_seconds`` (training time so far, over every launch, evaluations excluded: what a
  time budget spends), ``memory_metric`` and ``peak_bytes``;
- ``"kind": "eval"``: ``step``, ``loss`` (that step's training loss), ``val_loss`` (nats per
  token), ``val_bits_per_byte`` (the summed token losses over the bytes they stand for, so
  runs of any tokenizer compare), ``sample`` (text generated from the fixed prompt),
  ``train_seconds`` and ``best_step``: the step of the run's lowest ``val_loss`` so far, whose
  checkpoint the run keeps (records written before the field lack it, and name no best).

:func:`risen` is the one rule of "validation has risen": the training loop, its
``--early-stop`` and ``octlm report RUN`` all judge by it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from octlm import memory, records

METRICS = "metrics.jsonl"
PICTURE = "loss.png"
EXPERIMENT = "train"
# Evaluations after the best, none better, that say validation has risen (without --early-stop).
RISE = 3


def best_of(evaluations: Sequence[dict]) -> dict | None:
    """The evaluation (a record with ``step`` and ``val_loss``) of lowest validation loss, the
    first of equals; None when none has a finite one."""
    finite = [e for e in evaluations if math.isfinite(e["val_loss"])]
    return min(finite, key=lambda e: e["val_loss"], default=None)


def risen(evaluations: Sequence[dict], count: int = RISE) -> dict | None:
    """The best evaluation when validation has risen: ``count`` evaluations or more came after
    it, none of them better (the run is overfitting or diverging); None otherwise.
    ``evaluations`` are in step order."""
    best = best_of(evaluations)
    if best is None:
        return None
    after = sum(e["step"] > best["step"] for e in evaluations)
    return best if after >= count else None


def risen_line(evaluations: Sequence[dict], count: int = RISE) -> str | None:
    """What the run and its report say when validation has risen (:func:`risen`): since which
    step, and what to try; None while it has not."""
    best = risen(evaluations, count)
    if best is None:
        return None
    after = sum(e["step"] > best["step"] for e in evaluations)
    bits = best.get("val_bits_per_byte")
    figure = f"{bits:.3f} bits per byte" if isinstance(bits, int | float) else "its lowest loss"
    return (
        f"validation has risen for {after} evaluations since step {best['step']} ({figure}, "
        "the checkpoint kept as the best): the model is overfitting its data; try more data, "
        "--dropout, --weight-decay or a smaller model"
    )


def recorded_evaluations(folder: str | os.PathLike) -> list[dict]:
    """The run folder's evaluations that name the best (``best_step``), in step order; none
    for a folder without metrics or whose records predate the field."""
    path = Path(folder) / METRICS
    if not path.is_file():
        return []
    found = records.read(path, skipped=[])
    evaluations = [r for r in found if r["kind"] == "eval" and "best_step" in r]
    return sorted(evaluations, key=lambda r: r["step"])


def recorded_best(folder: str | os.PathLike) -> int | None:
    """The step of the run's best checkpoint as its metrics record it; None when they name none."""
    evaluations = recorded_evaluations(folder)
    return evaluations[-1]["best_step"] if evaluations else None


def peak_memory(device) -> dict:
    """The run's peak memory with the right instrument: CUDA allocator or process RSS."""
    return {"memory_metric": memory.metric(str(device)), "peak_bytes": memory.peak(str(device))}


class Metrics:
    """Appends records to ``folder/metrics.jsonl``; only the main rank writes."""

    def __init__(self, folder: str | os.PathLike, device, enabled: bool):
        self.path = Path(folder) / METRICS
        self.enabled = enabled
        self.machine = records.machine(device) if enabled else {}
        self.run = records.new_run()  # this launch's: a resumed run's records carry their own

    def write(self, kind: str, **fields) -> None:
        if self.enabled:
            record = records.make(kind, EXPERIMENT, self.machine, run=self.run, **fields)
            records.append(self.path, record)

    def forget_after(self, step: int) -> None:
        """Drop records past ``step``: a resumed run writes those steps again."""
        if not (self.enabled and self.path.exists()):
            return
        kept = []
        for line in self.path.read_bytes().splitlines(keepends=True):
            try:
                record = json.loads(line)  # NaN and inf losses too: a diverged run's records
            except ValueError:  # a torn line (not UTF-8 or not JSON): the run writes it again
                continue
            if isinstance(record, dict) and not _after(record.get("step", 0), step):
                kept.append(line if line.endswith(b"\n") else line + b"\n")
        temporary = self.path.with_name(f".{METRICS}.tmp")
        temporary.write_bytes(b"".join(kept))
        os.replace(temporary, self.path)


def _after(recorded, step: int) -> bool:
    """Whether a record's ``step`` field is a step past ``step`` (not a number: it is not)."""
    return isinstance(recorded, int | float) and recorded > step


def plot(folder: str | os.PathLike) -> Path:
    """Draw ``folder/loss.png``: training and validation loss (bits per byte) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    found = list(records.read(folder / METRICS))
    steps = [r for r in found if r.get("kind") == "train_step"]
    evals = [r for r in found if r.get("kind") == "eval"]
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    log2 = 0.6931471805599453
    # Records written before bits_per_byte existed are of byte tokens: loss / log 2 is that.
    train = [r.get("bits_per_byte", r["loss"] / log2) for r in steps]
    axes.plot([r["step"] for r in steps], train, label="train")
    axes.plot(
        [r["step"] for r in evals],
        [r["val_bits_per_byte"] for r in evals],
        marker="o",
        label="validation",
    )
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (bits per byte)")
    axes.set_title(f"{folder.name}: next-token loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = folder / PICTURE
    figure.savefig(path)
    plt.close(figure)
    return path
