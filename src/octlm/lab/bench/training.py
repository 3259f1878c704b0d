"""How fast ``octlm train`` runs: its overhead over a bare loop, and each attention's cost.

Two measurements, appended as records to ``--output`` (``runs/local/bench-training-cpu.jsonl``
unless told otherwise)::

    octlm bench training --what overhead   # train() against a bare loop, T = 256, 1024
    octlm bench training --what attention  # each attention at 1,024 and 4,096 tokens

``overhead`` alternates ``train()`` (data, schedule, clipping, records, progress bar) with a bare
loop of the same model and batch (forward, backward, AdamW step on one fixed batch), a few
times each, in one process, and compares their tokens per second over the steps after the
first. ``attention`` runs ``octlm train`` once per implementation, length, packing and dtype
(and round), each in a fresh process because ``ru_maxrss`` is a lifetime peak, and records that
run's tokens per second and peak memory. This is a benchmark, not a test: its figures depend on
the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from octlm import records
from octlm.lab.bench import suites
from octlm.lab.bench.decode import positive_int
from octlm.lab.bench.timing import time_calls
from octlm.model import OctLM
from octlm.signals import run_stoppable
from octlm.training import resolve
from octlm.training.batches import Batches
from octlm.training.corpus import Corpus, default_corpus
from octlm.training.formats import DEFAULT_GLOB
from octlm.training.metrics import METRICS, Metrics
from octlm.training.optim import make_optimizer, make_scheduler
from octlm.training.readers import find_files
from octlm.training.tokens import load_tokens, write_tokens

OUTPUT = str(records.LOCAL / "bench-training-cpu.jsonl")
TOKENS_PER_STEP = 4096  # batch x length, the same at every length
# Each of train()'s extras is timed in EXTRA_BLOCKS blocks of EXTRA_CALLS calls.
EXTRA_CALLS, EXTRA_BLOCKS = 100, 21


# Standard-library packages whose modules make the corpus: a few MB in documents of many sizes,
# enough for any batch, for rows packed with documents and for a validation split that holds a
# sequence of 4,096 tokens.
PACKAGES = ("asyncio", "email", "http", "json", "logging", "unittest", "xml")


def _corpus(folder: Path) -> Path:
    """The modules of :data:`PACKAGES`, one text file each."""
    root, glob = default_corpus()
    corpus = folder / "corpus"
    for package in PACKAGES:
        for document in find_files(root / package, glob):
            path = corpus / document.relative_to(root).with_suffix(".txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(document.read_bytes())
    return corpus


def _bare_loop(model_config, run, steps: int) -> float:
    """Tokens per second of forward, backward and AdamW step, over ``steps`` after a first."""
    torch.manual_seed(run.seed)
    model = OctLM(model_config)
    optimizer = make_optimizer(
        model, run.lr, run.weight_decay, optimizer=run.optimizer, muon_lr=run.muon_lr
    )
    tokens = torch.randint(256, (run.batch, run.length + 1))  # (B, T + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each

    def step() -> None:
        logits = model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    timed = time_calls(step, steps, warmup=1)
    return steps * run.batch * run.length / timed.wall_seconds


def _loop(model_config, run, steps: int, folder: Path) -> float:
    """Tokens per second of ``train()`` over steps ``steps + 1 .. 2 * steps``.

    The run logs every ``steps`` steps and goes one step further, so its second record times
    warm steps only, and the final evaluation and checkpoint come after it.
    """
    from octlm.training import train  # the loop: loaded when measured, not for `octlm --help`

    train(model_config, run, folder, overwrite=True, progress=True)
    found = [r for r in records.read(folder / METRICS) if r["kind"] == "train_step"]
    return next(r["tokens_per_second"] for r in found if r["step"] == 2 * steps)


def _extras(model_config, run, corpus: Path, scratch: Path) -> dict:
    """Seconds per step of what ``train()`` adds to the bare loop, each timed on its own.

    Drawing the batch from the memory-mapped tokens, clipping (the gradient norm), the
    schedule, and the progress bar; a logged step adds a record. Each is timed in blocks of
    :data:`EXTRA_CALLS` calls, the median block over the call count, so the figures hold up on
    a busy machine where whole-loop timings do not.
    """
    tokens_folder = scratch / "tokens"
    write_tokens(Corpus.open(corpus, DEFAULT_GLOB, run.val_share), tokens_folder)
    batches = Batches(load_tokens(tokens_folder, "train", run.length), run.length, 0)
    model = OctLM(model_config)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer = make_optimizer(
        model, run.lr, run.weight_decay, optimizer=run.optimizer, muon_lr=run.muon_lr
    )
    scheduler = make_scheduler(optimizer, warmup=run.warmup, steps=10**9, min_ratio=0.1)
    bar = tqdm(total=10**9, disable=False, file=open(os.devnull, "w"))  # noqa: SIM115
    log = Metrics(scratch, "cpu", enabled=True)
    statements = {
        "batch": lambda: batches.next(run.batch),
        "clip": lambda: nn.utils.clip_grad_norm_(model.parameters(), run.clip),
        "schedule": scheduler.step,
        "progress": bar.update,
        "record": lambda: log.write("train_step", step=0, loss=0.0),
    }
    timed = {}
    for name, statement in statements.items():

        def block(statement=statement) -> None:
            for _ in range(EXTRA_CALLS):
                statement()

        blocks = time_calls(block, EXTRA_BLOCKS, warmup=1).seconds
        timed[name] = statistics.median(blocks) / EXTRA_CALLS
    timed["record"] /= run.log_every  # one record per log_every steps
    return timed


def overhead(output: str, lengths=(256, 1024), steps: int = 5, repeats: int = 3) -> None:
    """``train()`` against the bare loop at each length, ``repeats`` times, interleaved."""
    with tempfile.TemporaryDirectory() as scratch:
        corpus = _corpus(Path(scratch))
        for length in lengths:
            run_values = dict(
                data=str(corpus),
                length=length,
                batch=TOKENS_PER_STEP // length,
                steps=2 * steps + 1,
                log_every=steps,
                eval_every=10**6,
                checkpoint_every=10**6,
                eval_batches=1,
                sample_tokens=0,
                tokenizer="bytes",  # the bare loop draws byte tokens
            )
            model_config, run = resolve(run=run_values)
            loop, bare = [], []
            for _ in range(repeats):  # interleaved: the machine's load hits both alike
                loop.append(_loop(model_config, run, steps, Path(scratch, "run")))
                bare.append(_bare_loop(model_config, run, steps))
            extras = _extras(model_config, run, corpus, Path(scratch))
            bare_step = run.batch * run.length / statistics.median(bare)  # seconds
            record = records.make("check", "train-overhead") | {
                "length": length,
                "batch": run.batch,
                "steps": steps,
                "repeats": repeats,
                "extras_seconds": extras,
                "bare_step_seconds": bare_step,
                "extras_share": sum(extras.values()) / bare_step,
                "loop_tokens_per_second": loop,
                "bare_tokens_per_second": bare,
                "loop_median": statistics.median(loop),
                "bare_median": statistics.median(bare),
                "overhead": 1 - statistics.median(loop) / statistics.median(bare),
            }
            records.append(output, record)
            print(json.dumps(record))


IMPLEMENTATIONS = ("naive", "sdpa", "tiled", "auto")


def attention(
    output: str,
    lengths=(1024, 4096),
    dtypes=("float32", "bfloat16"),
    steps: int = 6,
    implementations=IMPLEMENTATIONS,
    packing=(False,),
    rounds: int = 1,
) -> None:
    """One fresh ``octlm train`` process per (round, length, packing, dtype, implementation).

    Every run takes :data:`TOKENS_PER_STEP` tokens a step (``batch = TOKENS_PER_STEP //
    length``) for ``steps`` steps and logs twice: the record's tokens per second are those of
    the second half, past the first step's warm-up. The implementations alternate, reversed
    in even rounds, so that the machine's load falls on each alike.
    """
    half = max(1, steps // 2)
    with tempfile.TemporaryDirectory() as scratch:
        corpus = _corpus(Path(scratch))
        run_id = records.new_run()
        for round in range(1, rounds + 1):
            order = list(implementations) if round % 2 else list(reversed(implementations))
            for length in lengths:
                for packed in packing:
                    for dtype in dtypes:
                        for name in order:
                            record = _train_attention(
                                corpus, Path(scratch, "run"), name, length, packed, dtype, half
                            )
                            record |= {"run": run_id, "round": round}
                            records.append(output, record)
                            print(json.dumps(record))


def _train_attention(corpus, folder, name, length, packed, dtype, half) -> dict:
    """One ``octlm train`` process with attention ``name``, ``2 * half`` steps logged every
    ``half``; its record."""
    batch = max(1, TOKENS_PER_STEP // length)
    command = [
        sys.executable,
        "-m",
        "octlm",
        "train",
        "--data",
        str(corpus),
        "--out",
        str(folder),
        "--overwrite",
        "--attention",
        name,
        "--length",
        str(length),
        "--batch",
        str(batch),
        "--pack" if packed else "--no-pack",
        "--dtype",
        dtype,
        "--steps",
        str(2 * half),
        "--log-every",
        str(half),
        "--eval-every",
        str(10**6),
        "--checkpoint-every",
        str(10**6),
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        # fixed, not the defaults: the records compare attentions across the same recipe
        "--tokenizer",
        "bytes",
        "--optimizer",
        "adamw",
    ]
    finished = subprocess.run(command, capture_output=True, text=True)
    record = records.make("check", "train-attention") | {
        "attention": name,
        "length": length,
        "packed": packed,
        "dtype": dtype,
        "batch": batch,
        "steps": 2 * half,
        "status": "ok" if finished.returncode == 0 else "error",
    }
    if finished.returncode != 0:
        return record | {"reason": finished.stderr.strip().splitlines()[-1:]}
    last = [r for r in records.read(folder / METRICS) if r["kind"] == "train_step"][-1]
    return record | {key: last[key] for key in ("tokens_per_second", "memory_metric", "peak_bytes")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options, on ``parser`` (its own, or ``octlm bench``'s subcommand)."""
    parser.add_argument(
        "--what",
        nargs="+",
        choices=("overhead", "attention"),
        default=["overhead", "attention"],
        help="overhead: train() against a bare loop; attention: one octlm train per "
        "implementation (default both)",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=positive_int,
        metavar="T",
        help="tokens per row (default 256 1024 for overhead, 1024 4096 for attention)",
    )
    parser.add_argument("--steps", type=positive_int, help="steps per run (default 5, 6)")
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="overhead: runs of each, interleaved"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=("float32", "bfloat16"),
        default=["float32", "bfloat16"],
        help="attention: the training dtypes",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=IMPLEMENTATIONS,
        default=list(IMPLEMENTATIONS),
        help="attention: the implementations (default all)",
    )
    parser.add_argument(
        "--packing",
        nargs="+",
        choices=("off", "on"),
        default=["off"],
        help="attention: random windows (off), rows of whole documents (on), or both",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="attention: rounds of every run, the implementations alternating",
    )
    parser.add_argument("--output", default=OUTPUT, help="records file (default %(default)s)")


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The suite's exit status: 0, 1 when a record cannot be written, 128 + a stop signal."""
    if args.lengths and max(args.lengths) > TOKENS_PER_STEP:
        parser.error(
            f"--lengths must be at most {TOKENS_PER_STEP} (tokens per step), got {args.lengths}"
        )
    try:  # an unwritable output fails here, before the measurements
        records.check_writable(args.output, "--output")
    except ValueError as error:
        parser.error(str(error))
    sizes = {"lengths": args.lengths, "steps": args.steps}
    sizes = {name: value for name, value in sizes.items() if value is not None}

    def work() -> None:
        if "overhead" in args.what:
            overhead(args.output, repeats=args.repeats, **sizes)
        if "attention" in args.what:
            attention(
                args.output,
                dtypes=args.dtypes,
                implementations=args.attention,
                packing=[mode == "on" for mode in args.packing],
                rounds=args.rounds,
                **sizes,
            )

    return run_stoppable(
        parser.prog, work, {OSError: 1}, kept=f"finished records are in {args.output}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m`` this module: the same program as ``octlm bench`` with this suite."""
    return suites.run_program(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
