"""Each preset's training rate and its share of the machine's peak (MFU), eager and compiled,
in float32 and (where the CPU has the units) bfloat16: one fresh ``octlm train`` per cell.

    .venv/bin/python benchmarks/share_of_peak.py [--presets tiny small] [--steps 150]
        [--dtypes float32 bfloat16] [--data FILE] [--output FILE]

A cell's rate is the median ``tokens_per_second`` and ``mfu`` of its records after the first
third of its steps (a compiled run's first steps compile); the peak is the one the run
measured or found cached (``octlm.training.utilisation``). Every cell trains byte tokens in
the defaults' byte rows (8 x 256) on tiny shakespeare unless ``--data`` names another file.
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

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def cell(preset: str, dtype: str, compile: str, args: argparse.Namespace) -> dict:
    """One fresh run's late rate, share of peak and start line."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "run"
        flags = ["--data", str(args.data), "--out", str(folder), "--preset", preset]
        flags += ["--steps", str(args.steps), "--log-every", "5", "--eval-every", "1000000"]
        flags += ["--checkpoint-every", "1000000", "--tokenizer", "bytes", "--batch", "8"]
        flags += ["--length", "256", "--dtype", dtype, "--compile", compile]
        done = subprocess.run(
            [sys.executable, "-m", "octlm", "train", *flags], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"octlm train {' '.join(flags)} failed:\n{done.stderr[-2000:]}")
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, lines) if r["kind"] == "train_step"]
    late = [r for r in steps if r["step"] > args.steps // 3]
    return {
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in late),
        "model_flops_per_second": statistics.median(r["model_flops_per_second"] for r in late),
        "mfu": statistics.median(r["mfu"] for r in late) if "mfu" in late[0] else None,
        "peak_line": next((x for x in done.stdout.splitlines() if "MFLOP per token" in x), ""),
        "command": "octlm train " + " ".join(flags[4:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--data", type=Path, default=SHAKESPEARE)
    parser.add_argument("--output", type=Path, default=Path("runs/checks/share-of-peak.jsonl"))
    args = parser.parse_args()
    for preset in args.presets:
        for dtype in args.dtypes:
            for compile in ("off", "on"):
                found = cell(preset, dtype, compile, args)
                record = records.make("check", "share-of-peak", preset=preset, dtype=dtype)
                record |= {"compile": compile, "steps": args.steps, **found}
                records.append(args.output, record)
                share = "-" if found["mfu"] is None else f"{100 * found['mfu']:.1f}%"
                print(
                    f"{preset:6} {dtype:9} compile {compile:3}: "
                    f"{found['tokens_per_second']:8,.0f} tokens/s, "
                    f"{found['model_flops_per_second'] / 1e9:6.1f} GFLOP/s, MFU {share}"
                )
                print(f"    {found['peak_line']}")


if __name__ == "__main__":
    main()
