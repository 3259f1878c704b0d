"""Held-out bits per byte of training runs over their whole validation split, one protocol for
every tokenizer: a fairer final figure than a run's own evaluation, which samples windows.

    .venv/bin/python benchmarks/held_out_bits.py RUN_DIR [RUN_DIR ...] [--step best|last|N]
        [--output FILE]

Each run's checkpoint (``--step``: by default the best, which ``octlm sample`` and ``octlm
export`` take; the record says which) reads its validation tokens in consecutive windows of the
run's ``--length`` that overlap by one token, so every token after the first is predicted exactly
once, from at most ``length`` tokens of context. The summed losses (in bits) over the bytes those
targets stand for give bits per byte, on the same bytes whatever the tokenizer. One JSON record
per run is printed, and appended to ``--output`` when given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import octlm
from octlm import records
from octlm.training.folder import BEST, choose
from octlm.training.tokens import load_tokens

BATCH = 32  # windows per forward pass


def validation(folder: Path) -> tuple[int, Tensor]:
    """A run's ``--length`` and its validation tokens ``(N,)``."""
    length = json.loads((folder / "config.json").read_text())["run"]["length"]
    return length, load_tokens(folder / "data", "val", length).long()


def windows(tokens: Tensor, length: int) -> list[Tensor]:
    """``tokens (N,)`` in consecutive windows of ``length + 1`` that overlap by one token (the
    last may be shorter): every token after the first is a target exactly once."""
    return [tokens[start : start + length + 1] for start in range(0, len(tokens) - 1, length)]


def held_out(folder: Path, step: int | str = BEST) -> dict:
    """The record of one run at the checkpoint ``step`` names: its step, how it was chosen,
    and bits per byte over the whole validation split."""
    chosen = choose(folder, step)
    model, tokenizer, step = octlm.load_run(folder, step=chosen.step)
    length, tokens = validation(folder)
    token_bytes = tokenizer.token_bytes  # (V,)
    pieces = windows(tokens, length)
    full = [window for window in pieces if len(window) == length + 1]
    batches = [torch.stack(full[i : i + BATCH]) for i in range(0, len(full), BATCH)]  # (B, T + 1)
    batches += [window[None] for window in pieces if len(window) <= length]  # (1, < T + 1)
    nats, covered = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch[:, :-1])  # (B, T, V)
            targets = batch[:, 1:]  # (B, T)
            nats += F.cross_entropy(
                logits.flatten(0, 1).double(), targets.flatten(), reduction="sum"
            ).item()
            covered += int(token_bytes[targets].sum())
    return records.make("check", "held-out-bits") | {
        "folder": str(folder), "step": step, "checkpoint": chosen.how, "tokenizer": tokenizer.name,
        "length": length, "targets": len(tokens) - 1, "bytes": covered,
        "bits_per_byte": nats / math.log(2) / covered,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--step",
        type=lambda text: int(text) if text.isdigit() else text,
        default=BEST,
        help="each run's checkpoint: best (the lowest validation loss; the last where the run "
        "records none), last, or a step (default %(default)s)",
    )
    parser.add_argument("--output", type=Path, help="records file to append to")
    args = parser.parse_args(argv)
    for folder in args.runs:
        record = held_out(folder, args.step)
        if args.output is not None:
            records.append(args.output, record)
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
