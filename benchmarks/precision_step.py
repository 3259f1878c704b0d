"""A training step in bfloat16 autocast against float32, side by side in one process.

    .venv/bin/python benchmarks/precision_step.py [--rounds 7] [--steps 5] [--output FILE]

For the tiny preset with a byte vocabulary (256) and with the defaults' BPE (4,096), and the
small preset with 4,096, each round times ``--steps`` optimizer steps (forward, backward,
gradient clipping, Muon for the blocks' matrices and AdamW for the rest, as ``octlm train``
runs them) in float32 and then in bfloat16 autocast (Muon's iteration in bfloat16 too), the
order reversed every other round so that a drift in the machine's speed hits both alike; a
warm-up step of each comes first. It prints, per model, the median seconds per step of each
dtype and the bfloat16 ÷ float32 ratio of each round (median, min–max), and appends one
record per model to ``--output`` when given. What ``--dtype auto`` would pick here is printed
too. As ``octlm train`` does on CPU, the process keeps large freed blocks for reuse
(:mod:`octlm.training.allocator`; its own effect: ``benchmarks/allocator_step.py``). This is
a benchmark, not a test: its figures belong to the machine it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from octlm import records
from octlm.model import ModelConfig, OctLM
from octlm.training.allocator import keep_freed_memory
from octlm.training.config import PRESETS
from octlm.training.optim import make_optimizer
from octlm.training.precision import resolve_dtype

BATCH, LENGTH = 16, 128  # octlm train's default batch and row length
MODELS = {
    "tiny, vocabulary 256": ("tiny", 256),
    "tiny, vocabulary 4,096": ("tiny", 4096),  # the defaults' model and BPE
    "small, vocabulary 4,096": ("small", 4096),
}


def stepper(preset: str, vocab: int, dtype: torch.dtype):
    """A function that runs one training step of a fresh model in ``dtype`` autocast."""
    torch.manual_seed(0)
    model = OctLM(ModelConfig(vocab_size=vocab, max_length=LENGTH, **PRESETS[preset]))
    optimizer = make_optimizer(model, 3e-3, 0.1, optimizer="muon", muon_lr=6e-3, precision=dtype)
    tokens = torch.randint(vocab, (BATCH, LENGTH + 1))  # (B, T + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        with autocast:
            logits = model(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def seconds_per_step(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def ratio_fields(ratios: list[float]) -> dict:
    """Per-round ratios as a record keeps them: median, min and max."""
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def ratio_text(record: dict, rounds: int) -> str:
    """A record's ratio as printed: ``median (min–max, N rounds)``."""
    low, high = record["ratio_min"], record["ratio_max"]
    return f"{record['ratio_median']:.3f} ({low:.3f}–{high:.3f}, {rounds} rounds)"


def alternate(runs: dict, rounds: int, measure) -> tuple[dict, list[float]]:
    """Time ``runs`` (float32 and bfloat16, each warmed up once) by ``measure`` once a round,
    the order reversed every other round; the times per dtype and each round's bfloat16 ÷
    float32 ratio."""
    for run in runs.values():
        run()  # warm-up
    times = {dtype: [] for dtype in runs}
    for round in range(rounds):
        order = list(runs) if round % 2 == 0 else list(reversed(runs))
        for dtype in order:
            times[dtype].append(measure(runs[dtype]))
    ratios = [b / f for f, b in zip(times[torch.float32], times[torch.bfloat16], strict=True)]
    return times, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per dtype and round")
    parser.add_argument("--output", help="append one record per model to this file")
    args = parser.parse_args()
    kept = keep_freed_memory()
    print(f"large freed blocks kept for reuse: {'yes' if kept else 'no'}")
    print(f"--dtype auto here: {resolve_dtype('auto', torch.device('cpu'))}")
    for label, (preset, vocab) in MODELS.items():
        steps = {d: stepper(preset, vocab, d) for d in (torch.float32, torch.bfloat16)}
        times, ratios = alternate(
            steps, args.rounds, lambda step: seconds_per_step(step, args.steps)
        )
        record = (
            records.make("check", "precision-step")
            | {
                "model": label,
                "batch": BATCH,
                "length": LENGTH,
                "rounds": args.rounds,
                "steps": args.steps,
                "freed_memory_kept": kept,
                "float32_seconds": times[torch.float32],
                "bfloat16_seconds": times[torch.bfloat16],
            }
            | ratio_fields(ratios)
        )
        print(
            f"{label}: float32 {statistics.median(times[torch.float32]) * 1e3:.1f} ms/step, "
            f"bfloat16 {statistics.median(times[torch.bfloat16]) * 1e3:.1f} ms/step; "
            f"bfloat16 ÷ float32 {ratio_text(record, args.rounds)}"
        )
        if args.output:
            records.append(args.output, record)


if __name__ == "__main__":
    main()
