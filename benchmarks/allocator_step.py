"""A training step with glibc keeping large freed blocks against glibc's defaults, in fresh
processes.

    .venv/bin/python benchmarks/allocator_step.py [--rounds 5] [--steps 12] [--output FILE]

The setting (:mod:`octlm.training.allocator`) is process-wide and cannot be undone, so each
measurement is its own process: every round starts one with the setting and one without, the
order reversed every other round so that a drift in the machine's speed hits both alike. Each
process builds the defaults' model (tiny preset, vocabulary 4,096) with the dtype that
``--dtype auto`` picks here, runs two warm-up steps, then times ``--steps`` optimizer steps as
``benchmarks/precision_step.py`` runs them, and reports seconds per step and its peak resident
size. Printed: the median of each arm, each round's kept ÷ default ratio (median, min–max) and
the peak sizes; with ``--output``, one record appended. A benchmark, not a test: its figures
belong to the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from octlm import records
from octlm.training.allocator import keep_freed_memory
from octlm.training.precision import resolve_dtype

sys.path.insert(0, str(Path(__file__).parent))
from precision_step import ratio_fields, ratio_text, seconds_per_step, stepper

ARMS = ("kept", "default")
PRESET, VOCAB = "tiny", 4096  # the defaults' model and BPE


def child(arm: str, steps: int) -> None:
    """One measurement: prints ``{"seconds": ..., "peak_bytes": ...}``."""
    if arm == "kept" and not keep_freed_memory():
        raise SystemExit("the allocator setting does not apply here (glibc on Linux only)")
    dtype = getattr(torch, resolve_dtype("auto", torch.device("cpu")))
    step = stepper(PRESET, VOCAB, dtype)
    step()
    step()  # warm-up
    seconds = seconds_per_step(step, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "dtype": str(dtype)}))


def measure(arm: str, steps: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", arm, "--steps", str(steps)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per process")
    parser.add_argument("--output", help="append one record to this file")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.steps)
    results = {arm: [] for arm in ARMS}
    for round in range(args.rounds):
        for arm in ARMS if round % 2 == 0 else reversed(ARMS):
            results[arm].append(measure(arm, args.steps))
            print(f"round {round + 1} {arm}: {results[arm][-1]['seconds'] * 1e3:.1f} ms/step")
    seconds = {arm: [r["seconds"] for r in results[arm]] for arm in ARMS}
    peaks = {arm: max(r["peak_bytes"] for r in results[arm]) for arm in ARMS}
    ratios = [k / d for k, d in zip(seconds["kept"], seconds["default"], strict=True)]
    record = (
        records.make("check", "allocator-step")
        | {
            "model": f"{PRESET}, vocabulary {VOCAB:,}",
            "dtype": results["kept"][0]["dtype"],
            "rounds": args.rounds,
            "steps": args.steps,
            "kept_seconds": seconds["kept"],
            "default_seconds": seconds["default"],
            "kept_peak_bytes": peaks["kept"],
            "default_peak_bytes": peaks["default"],
        }
        | ratio_fields(ratios)
    )
    print(
        f"{record['model']}, {record['dtype']}: kept {statistics.median(seconds['kept']) * 1e3:.1f}"
        f" ms/step, default {statistics.median(seconds['default']) * 1e3:.1f} ms/step; kept ÷ "
        f"default {ratio_text(record, args.rounds)}; peak resident "
        f"{peaks['kept'] / 2**20:,.0f} MiB against {peaks['default'] / 2**20:,.0f} MiB"
    )
    if args.output:
        records.append(args.output, record)


if __name__ == "__main__":
    main()
