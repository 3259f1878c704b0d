"""Compiled training steps at 256-token packed rows: sdpa, tiled and auto side by side.

    .venv/bin/python benchmarks/packed_compiled.py [--rounds 3] [--steps 60] [--output FILE]

Each round trains ``octlm train --tokenizer bytes --pack --length 256 --batch 16 --compile on``
on the default corpus once per attention, fresh processes, the order reversed every other
round, and takes the median tokens per second after step 20. One check record per run; the
summary gives auto's step time over the faster path's, round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from octlm import records

ATTENTIONS = ("sdpa", "tiled", "auto")


def rate(folder: Path, attention: str, steps: int) -> float:
    """Median tokens per second after step 20 of one fresh compiled run."""
    flags = ["--tokenizer", "bytes", "--pack", "--length", "256", "--batch", "16"]
    flags += ["--attention", attention, "--compile", "on", "--steps", str(steps)]
    flags += ["--log-every", "1", "--eval-every", "100000", "--checkpoint-every", "100000"]
    subprocess.run(
        [sys.executable, "-m", "octlm", "train", *flags, "--out", str(folder)],
        check=True,
        capture_output=True,
    )
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    steps_ = [json.loads(line) for line in lines]
    return statistics.median(
        r["tokens_per_second"] for r in steps_ if r["kind"] == "train_step" and r["step"] > 20
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output", type=Path, default=Path("runs/checks/packed_compiled.jsonl"))
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = ATTENTIONS if index % 2 == 0 else ATTENTIONS[::-1]
            rates = {a: rate(Path(scratch) / f"{index}-{a}", a, args.steps) for a in order}
            for attention, tokens_per_second in rates.items():
                record = records.make(
                    "check", "packed-compiled", round=index, attention=attention,
                    tokens_per_second=tokens_per_second,
                )  # fmt: skip
                records.append(args.output, record)
            ratios.append(max(rates["sdpa"], rates["tiled"]) / rates["auto"])
            print(index, {a: round(r) for a, r in rates.items()}, flush=True)
    print(
        f"auto's step over the faster path's: median {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)"
    )


if __name__ == "__main__":
    main()
