"""One trial of the training-recipe search: ``octlm train`` with the given flags, judged by CPU
time rather than wall-clock time (a shared machine disturbs the first far less).

    OMP_NUM_THREADS=1 python scripts/recipe_trial.py NAME --steps 400 --batch 32 ...

Runs in this process on one thread, with the default corpus's token files written once to
``--cache`` and copied into each run folder (their preparation is no part of a trial). Every
record of ``metrics.jsonl`` gets ``cpu_seconds``: this process's user + system CPU time spent
training since ``train`` was called, checkpoints and evaluations left out. At the end the last
checkpoint is evaluated on a common protocol whatever the run's length (1,024 validation
windows of 128 bytes, and of the run's length when longer), and one line of JSON with the
trial's figures is appended to ``runs/recipe/trials.jsonl``; ``metrics.jsonl`` is copied to
``runs/recipe/NAME.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from octlm.training import config, data, loop, metrics
from octlm.training.sample import load_run

RECORDS = Path("runs/recipe")
PROTOCOL_WINDOWS = 1024


def _cpu() -> float:
    return time.process_time()  # user + system of this process, all threads


def _protocol_bits_per_byte(folder: Path, length: int) -> float:
    """Mean loss in bits per byte of the run's last checkpoint over ``PROTOCOL_WINDOWS``
    validation windows of ``length`` spread evenly over the split."""
    model, _step = load_run(folder)
    model.eval()
    tokens = data.load_tokens(folder / loop.DATA_FOLDER, "val", length)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.evaluation_batches(tokens, length, 64, PROTOCOL_WINDOWS // 64):
            logits = model(batch.inputs)  # (B, T, V)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"
            )
            total, count = total + loss.item(), count + batch.targets.numel()
    return total / count / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--cache", default="/tmp/recipe/tokens")
    parser.add_argument("--scratch", default="/tmp/recipe/runs")
    parser.add_argument("--preset", default=None)
    config.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_values, run_values = config.explicit_values(args)
    model_config, run = config.resolve(args.preset, model=model_values, run=run_values)

    cache = Path(args.cache)
    if data.read_summary(cache) is None:
        source, glob = data.default_corpus()
        data.write_tokens(source, glob, run.val_share, cache)

    def copied_tokens(_source, _glob, _val_share, folder):
        shutil.copytree(cache, folder, dirs_exist_ok=True)
        return data.read_summary(folder)

    loop.data.write_tokens = copied_tokens

    # Training CPU time: the clock stops from each checkpoint to the end of what follows it
    # (the evaluation and the loss picture, where there is one).
    clock = {"start": 0.0, "paused": 0.0, "pause_began": None}
    write, save, plot = metrics.Metrics.write, loop._save, loop.plot

    def resume_clock():
        clock["paused"] += _cpu() - clock["pause_began"]
        clock["pause_began"] = None

    def timed_write(self, kind, **fields):
        now = clock["pause_began"] or _cpu()
        fields["cpu_seconds"] = now - clock["start"] - clock["paused"]
        write(self, kind, **fields)

    def timed_save(*save_args):
        clock["pause_began"] = _cpu()
        save(*save_args)
        step = save_args[1]
        if step % run.eval_every and step != run.steps:  # no evaluation follows
            resume_clock()

    def timed_plot(*plot_args):
        plot(*plot_args)
        resume_clock()

    metrics.Metrics.write, loop._save, loop.plot = timed_write, timed_save, timed_plot
    folder = Path(args.scratch) / args.name
    shutil.rmtree(folder, ignore_errors=True)
    clock["start"], began_wall = _cpu(), time.perf_counter()
    outcome = loop.train(model_config, run, folder, progress=False)
    process_cpu, wall = _cpu() - clock["start"], time.perf_counter() - began_wall

    found = [json.loads(line) for line in (folder / metrics.METRICS).read_text().splitlines()]
    train_cpu = [r for r in found if r["kind"] == "train_step"][-1]["cpu_seconds"]
    tokens = run.steps * run.batch * run.length
    result = {
        "name": args.name,
        "argv": sys.argv[1:],
        "steps": run.steps,
        "batch": run.batch,
        "length": run.length,
        "tokens": tokens,
        "train_cpu_seconds": round(train_cpu, 1),
        "process_cpu_seconds": round(process_cpu, 1),
        "wall_seconds": round(wall, 1),
        "tokens_per_cpu_second": round(tokens / train_cpu, 1),
        "val_bits_per_byte": outcome.val_bits_per_byte,
        "protocol_128": _protocol_bits_per_byte(folder, 128),
    }
    if run.length > 128:
        result[f"protocol_{run.length}"] = _protocol_bits_per_byte(folder, run.length)
    RECORDS.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / metrics.METRICS, RECORDS / f"{args.name}.jsonl")
    with (RECORDS / "trials.jsonl").open("a") as out:
        out.write(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
