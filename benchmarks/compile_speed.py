"""Compiled against eager training steps: tokens per second of ``octlm train --compile on``
over ``--compile off``, in interleaved fresh processes, with the compilation's cost.

    .venv/bin/python benchmarks/compile_speed.py [--preset tiny] [--steps 120] [--rounds 3]
        [--data FILE] [--output FILE] [-- EXTRA TRAIN FLAGS]

Each round trains eager, then compiled (the order alternating between rounds), each a fresh
``octlm train`` on the same data and flags. A run's rate is the median ``tokens_per_second``
of its records after the first third of its steps (the compiled run's first steps compile);
its first-step time is the training clock at step 1, which holds the compilation. One JSON
record per round gives both rates, their ratio and the machine's CPU time spent by other
processes meanwhile; the summary is the median ratio and its spread.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from octlm import records
from octlm.lab.bench.timing import machine_cpu_seconds

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def train(folder: Path, mode: str, args: argparse.Namespace) -> dict:
    """One fresh ``octlm train`` with ``--compile mode``: its late rate and first-step time."""
    flags = ["--data", str(args.data), "--out", str(folder), "--preset", args.preset]
    flags += ["--steps", str(args.steps), "--log-every", "1", "--eval-every", "1000000"]
    flags += ["--checkpoint-every", "1000000", "--compile", mode, *args.extra]
    children_before, machine_before = _children_cpu(), machine_cpu_seconds()
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "octlm", "train", *flags], capture_output=True, text=True
    )
    wall = time.perf_counter() - began
    others = machine_cpu_seconds() - machine_before - (_children_cpu() - children_before)
    if done.returncode != 0:
        raise SystemExit(f"octlm train --compile {mode} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train_step"]
    late = [r["tokens_per_second"] for r in steps if r["step"] > args.steps // 3]
    return {
        "tokens_per_second": statistics.median(late),
        "first_step_seconds": steps[0]["train_seconds"],
        "wall_seconds": wall,
        "others_seconds": others,  # CPU time of other processes meanwhile (and this one's)
        "compiled_line": next(
            (line for line in done.stdout.splitlines() if line.startswith("model ")), ""
        ),
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=SHAKESPEARE)
    parser.add_argument("--output", type=Path, default=Path("runs/checks/compile_speed.jsonl"))
    parser.add_argument("extra", nargs="*", help="more octlm train flags, after --")
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for round in range(args.rounds):
            modes = ("off", "on") if round % 2 == 0 else ("on", "off")
            result = {mode: train(Path(scratch) / f"{round}-{mode}", mode, args) for mode in modes}
            ratio = result["on"]["tokens_per_second"] / result["off"]["tokens_per_second"]
            ratios.append(ratio)
            record = records.make(
                "check", "compile-speed", preset=args.preset, steps=args.steps, extra=args.extra
            )
            record |= {"round": round, "ratio": ratio, "eager": result["off"]}
            record["compiled"] = result["on"]
            print(json.dumps(record), flush=True)
            records.append(args.output, record)
    print(
        f"{args.preset}: compiled/eager tokens per second, median {statistics.median(ratios):.3f} "
        f"(from {min(ratios):.3f} to {max(ratios):.3f}, {len(ratios)} rounds)"
    )


if __name__ == "__main__":
    main()
