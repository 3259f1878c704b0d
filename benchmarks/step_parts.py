"""Where a training step's time goes: forward and loss, backward, and the optimizer step, eager
and with the forward and loss compiled as ``octlm train --compile on`` compiles them.

    .venv/bin/python benchmarks/step_parts.py [--preset tiny] [--vocab 4096] [--steps 30]
        [--dtype auto|float32|bfloat16] [--output FILE]

One process; the default recipe's shapes (16 x 128 tokens, Muon, bfloat16 autocast where the
CPU has bfloat16 units), large freed blocks kept as ``octlm train`` keeps them on a CPU. Each
part is timed on its own with ``time.perf_counter`` over ``--steps`` steps after five warm-up
steps (the compilation among them); the record gives each part's median milliseconds, eager
and compiled, and the share of the host's peak (octlm.training.utilisation) that the forward
and the backward reach: a third of the model's FLOPs per token in the forward, two thirds in
the backward (docs/benchmarks.md, 'Share of peak'); the optimizer's products are no model
FLOPs, so its time is given as its share of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from octlm import records
from octlm.model import ModelConfig, OctLM
from octlm.training.allocator import keep_freed_memory
from octlm.training.config import PRESETS, TRAINING_DTYPES
from octlm.training.loop import _summed_loss
from octlm.training.optim import make_optimizer
from octlm.training.precision import resolve_dtype
from octlm.training.utilisation import flops_per_token, peak

BATCH, LENGTH = 16, 128


def parts(model: OctLM, loss, optimizer, tokens, dtype, steps: int) -> dict[str, float]:
    """Median milliseconds of each part of a step over ``steps`` steps, after 5 untimed."""
    times = {"forward and loss": [], "backward": [], "optimizer": []}
    for index in range(5 + steps):
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            value = loss(model, tokens[:, :-1], tokens[:, 1:], None)
        forward = time.perf_counter()
        value.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        if index >= 5:
            times["forward and loss"].append(forward - began)
            times["backward"].append(backward - forward)
            times["optimizer"].append(done - backward)
    return {name: 1000 * statistics.median(seconds) for name, seconds in times.items()}


def shares(milliseconds: dict[str, float], config: ModelConfig, dtype: str) -> dict[str, float]:
    """Each part's share: of the host's peak FLOP/s for the forward and the backward, of the
    step's time for the optimizer."""
    flops = flops_per_token(config, LENGTH) * BATCH * LENGTH  # a step's model FLOPs
    best = peak(torch.device("cpu"), dtype)
    step = sum(milliseconds.values())
    found = {"optimizer, of the step": round(milliseconds["optimizer"] / step, 3)}
    if best is not None:
        for name, third in (("forward and loss", 1), ("backward", 2)):
            rate = flops * third / 3 / (milliseconds[name] / 1000)
            found[f"{name}, of peak"] = round(rate / best, 3)
        found["step, of peak"] = round(flops / (step / 1000) / best, 3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--output", type=Path, default=Path("runs/checks/step_parts.jsonl"))
    args = parser.parse_args()
    keep_freed_memory()
    dtype = TRAINING_DTYPES[resolve_dtype(args.dtype, torch.device("cpu"))]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (BATCH, LENGTH + 1), generator=generator)  # (B, T+1)
    record = records.make("check", "step-parts", preset=args.preset, vocab=args.vocab)
    record |= {"dtype": str(dtype).removeprefix("torch."), "batch": BATCH, "length": LENGTH}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        config = ModelConfig(vocab_size=args.vocab, max_length=LENGTH, **PRESETS[args.preset])
        model = OctLM(config)
        optimizer = make_optimizer(
            model, 3e-3, 0.1, optimizer="muon", muon_lr=6e-3, precision=dtype
        )
        loss = torch.compile(_summed_loss) if mode == "compiled" else _summed_loss
        record[mode] = parts(model, loss, optimizer, tokens, dtype, args.steps)
        record[f"{mode} share"] = shares(record[mode], config, record["dtype"])
        print(mode, {name: round(ms, 1) for name, ms in record[mode].items()}, flush=True)
        print(f"{mode} share", record[f"{mode} share"], flush=True)
    print(json.dumps(record))
    records.append(args.output, record)


if __name__ == "__main__":
    main()
