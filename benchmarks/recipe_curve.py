"""Held-out bits per byte against training seconds, one line per run, from each run's
``metrics.jsonl`` (its ``eval`` records): the picture of docs/training.md's recipe comparison.

    .venv/bin/python benchmarks/recipe_curve.py runs/recipe/old runs/recipe/new \\
        --labels "old defaults" "new defaults" --output docs/images/recipe-curve.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from octlm import records


def curve(folder: Path) -> tuple[list[float], list[float]]:
    """``(training seconds, held-out bits per byte)`` at each evaluation of the run."""
    found = [r for r in records.read(folder / "metrics.jsonl") if r["kind"] == "eval"]
    return [r["train_seconds"] for r in found], [r["val_bits_per_byte"] for r in found]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--labels", nargs="+", help="one per run (default: the folder names)")
    parser.add_argument("--title", default="octlm train on 2 CPU cores, default corpus")
    parser.add_argument("--output", type=Path, required=True, help="a .png file")
    args = parser.parse_args(argv)
    labels = args.labels or [folder.name for folder in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels needs one label per run ({len(args.runs)}), got {len(labels)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for folder, label in zip(args.runs, labels, strict=True):
        seconds, bits = curve(folder)
        axes.plot(seconds, bits, marker="o", markersize=3, label=f"{label}: {bits[-1]:.3f}")
    axes.set_xlabel("training seconds (evaluations excluded)")
    axes.set_ylabel("held-out bits per byte")
    axes.set_title(args.title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
