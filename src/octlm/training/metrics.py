"""A run's records (``RUN_DIR/metrics.jsonl``) and its loss-curve picture.

One JSON object per line, appended and fsynced as it is written (docs/design.md, 'Records'), with
the context fields and the ``run`` id every octlm record carries (one id per launch: a resumed run
writes under a new one). A diverged run's losses are NaN or infinite and are kept as such. Lines are
of two kinds:

- ``"kind": "train_step"``: ``step`` (optimizer steps done), ``loss`` (that step's, over the
  whole global batch, in nats per token), ``bits_per_byte`` (the same loss over the bytes its
  targets stand for), ``lr``, ``grad_norm``, ``tokens_per_second`` (since the last record),
  ``train_seconds`` (training time so far, over every launch, evaluations excluded: what a
  time budget spends), ``memory_metric`` and ``peak_bytes``;
- ``"kind": "eval"``: ``step``, ``loss`` (that step's training loss), ``val_loss`` (nats per
  token), ``val_bits_per_byte`` (the summed token losses over the bytes they stand for, so
  runs of any tokenizer compare), ``sample`` (text generated from the fixed prompt) and
  ``train_seconds``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from octlm import memory, records

METRICS = "metrics.jsonl"
PICTURE = "loss.png"
EXPERIMENT = "train"


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
