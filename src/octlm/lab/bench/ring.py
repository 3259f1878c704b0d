"""Ring attention over W CPU processes against tiled attention in one, at the same total length.

    python -m octlm.lab.bench.ring                # 8,192 tokens; W = 1 (tiled), 2, 4; both modes
    python -m octlm.lab.bench.ring --length 256 --repeats 2 --output /tmp/ring.jsonl   # smoke run

Each measurement (one world size, one mode) runs in fresh processes, one per rank, joined by a
gloo process group over a file store: ``ru_maxrss`` is a lifetime peak, so nothing may run in a
process before it. ``W = 1`` is the baseline, ``tiled_attention`` on the whole sequence. The
machine's threads are shared out: each of the ``W`` ranks gets ``threads // W``.

A repeat is timed from a barrier to a barrier, so it lasts as long as the slowest rank. Each record
(kind ``ring``) carries the benchmark fields of docs/design.md, 'Records', and ``world_size``,
``layout``, and ``rank_peak_bytes`` (every rank's ``ru_maxrss``); ``peak_bytes`` is the largest of
those, and ``baseline_bytes``/``extra_bytes`` are that rank's figures. Options that would make a
record say something other than what ran (a length that the layout cannot split over a world size,
no repeats) are refused before anything runs.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octlm import memory, records, signals
from octlm.attention import ring_attention, tiled_attention
from octlm.attention.tiled.options import DEFAULT_BLOCK
from octlm.context_parallel import DEFAULT_LAYOUT, LAYOUTS
from octlm.lab.bench import guard, suites
from octlm.lab.bench.suites import DTYPES, MODES
from octlm.lab.bench.timing import time_calls

EXPERIMENT = "bench-ring"
OUTPUT = records.LOCAL / "bench-ring-cpu.jsonl"


def _worker(rank: int, spec: dict, folder: str) -> None:
    """One rank of one measurement; writes ``rank<r>.json`` with its times and memory."""
    world = spec["world_size"]
    guard.die_with_parent(spec["parent"])
    torch.set_num_threads(max(1, spec["threads"] // world))
    result = {"pid": os.getpid(), "threads": torch.get_num_threads()}
    try:
        if world > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{folder}/store",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=spec["timeout"]),
            )
        result.update(_measure(rank, spec))
        if world > 1:
            dist.destroy_process_group()
    except Exception as error:
        result.update(status="error", reason=f"{type(error).__name__}: {error}"[:2000])
        traceback.print_exc()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))


def _measure(rank: int, spec: dict) -> dict:
    """Warm up, time the repeats, read the memory figures."""
    world, train = spec["world_size"], spec["mode"] == "train"
    dtype = getattr(torch, spec["dtype"])
    generator = torch.Generator().manual_seed(rank)
    local_len = spec["length"] // world

    def tensor(heads: int) -> torch.Tensor:
        shape = (spec["batch"], heads, local_len, spec["head_size"])
        x = torch.randn(shape, generator=generator).to(dtype)  # (B, heads, T/W, D)
        return x.requires_grad_(train)

    query, key, value = tensor(spec["heads"]), tensor(spec["kv_heads"]), tensor(spec["kv_heads"])
    grad_out = torch.randn_like(query) if train else None  # (B, H, T/W, D)
    options = dict(causal=spec["causal"], window=spec["window"], block=tuple(spec["block"]))
    if world > 1:
        options["layout"] = spec["layout"]

    def step() -> None:
        attend = ring_attention if world > 1 else tiled_attention
        out = attend(query, key, value, **options)
        if train:
            out.backward(grad_out)
            query.grad = key.grad = value.grad = None

    baseline = memory.baseline("cpu")
    barrier = dist.barrier if world > 1 else None  # a repeat lasts as long as the slowest rank
    timed = time_calls(step, spec["repeats"], warmup=spec["warmup"], fence=barrier)
    return {
        "status": "ok",
        "seconds": timed.seconds,
        "baseline": baseline,
        "peak": memory.peak("cpu"),
    }


RUN_FIELDS = ("threads", "timeout", "parent", "run")  # how to run, not what is measured


def measure(spec: dict) -> dict:
    """Run one measurement in ``spec["world_size"]`` fresh processes; return its record."""
    world = spec["world_size"]
    fields = {name: value for name, value in spec.items() if name not in RUN_FIELDS}
    results = dict.fromkeys(("status", "reason", "seconds_median", "seconds_iqr", "seconds"))
    results.update(memory_metric=memory.metric("cpu"))
    results.update(dict.fromkeys(("peak_bytes", "baseline_bytes", "extra_bytes", "pid")))
    results.update(rank_peak_bytes=None)
    with tempfile.TemporaryDirectory(prefix="octlm-ring-") as folder:
        context = mp.start_processes(
            _worker, args=(spec, folder), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + spec["timeout"]
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    _kill(context)
                    results.update(status="timeout", reason=f"no result in {spec['timeout']} s")
                    return _record(spec, fields, results)
        except mp.ProcessExitedException as error:
            results.update(status="error", reason=str(error)[:2000])
            return _record(spec, fields, results)
        except BaseException:  # Ctrl-C, SIGTERM, SIGHUP: leave no rank behind
            _kill(context)
            raise
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    failed = [r for r in ranks if r["status"] != "ok"]
    if failed:
        results.update(status=failed[0]["status"], reason=failed[0]["reason"])
        return _record(spec, fields, results, threads=ranks[0]["threads"])
    top = max(ranks, key=lambda r: r["peak"])
    results.update(
        status="ok",
        **records.timing(ranks[0]["seconds"]),  # barrier to barrier: the slowest rank's time
        peak_bytes=top["peak"],
        baseline_bytes=top["baseline"],
        extra_bytes=top["peak"] - top["baseline"],
        pid=top["pid"],
        rank_peak_bytes=[r["peak"] for r in ranks],
    )
    return _record(spec, fields, results, threads=ranks[0]["threads"])


def _record(spec: dict, fields: dict, results: dict, threads: int | None = None) -> dict:
    """The ``ring`` record; ``threads`` is what each rank ran with."""
    record = records.make("ring", EXPERIMENT, "cpu", run=spec.get("run"), **fields, **results)
    if threads is not None:
        record["threads"] = threads
    return record


def _kill(context) -> None:
    for process in context.processes:
        process.kill()
        process.join()


def check(args: argparse.Namespace) -> None:
    """Refuse options that no run could honour, naming the option; before anything runs."""
    for name in ("worlds", "repeats", "length", "heads", "kv_heads", "head_size", "batch"):
        values = getattr(args, name)
        values = values if isinstance(values, list) else [values]
        if any(value < 1 for value in values):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        raise ValueError(
            f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
        )
    if args.warmup < 0 or args.window < 0 or args.threads < 1:
        raise ValueError("--warmup and --window must be >= 0, --threads >= 1")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ValueError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    for world in args.worlds:
        chunks = 2 * world if args.layout == "zigzag" and world > 1 else world
        if args.length % chunks:
            raise ValueError(
                f"--length ({args.length}) must be a multiple of {chunks} to split over "
                f"{world} ranks in the {args.layout} layout; each rank holds an equal shard"
            )
    records.check_writable(args.output, "--output")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options, on ``parser`` (its own, or ``octlm bench``'s subcommand)."""
    parser.add_argument("--length", type=int, default=8192, help="total tokens, all ranks")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="1 = tiled")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--layout", choices=LAYOUTS, default=DEFAULT_LAYOUT)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="in all")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    parser.add_argument("--output", default=str(OUTPUT), help="records file (default %(default)s)")


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The suite's exit status: 0, 2 for options no run could honour, 1 when a record cannot
    be written, 128 + a stop signal."""

    def work() -> None:
        check(args)
        run = records.new_run()
        for world, mode in itertools.product(args.worlds, args.modes):
            spec = _spec(args, world, mode, run)
            record = measure(spec)
            records.append(args.output, record)
            summary = (
                f"{record['seconds_median']:.3f} s, peak {record['peak_bytes'] / 2**20:.0f} MiB"
                if record["status"] == "ok"
                else f"{record['status']}: {record['reason']}"
            )
            print(f"{spec['backend']} W={world} {mode}: {summary}", flush=True)

    return signals.run_stoppable(
        parser.prog, work, {ValueError: 2, OSError: 1}, kept=f"records kept in {args.output}"
    )


def _spec(args: argparse.Namespace, world: int, mode: str, run: str) -> dict:
    return {
        "backend": "ring" if world > 1 else "tiled",
        "mode": mode,
        "dtype": args.dtype,
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_size": args.head_size,
        "length": args.length,
        "q_len": args.length,
        "causal": True,
        "window": args.window,
        "padding": 0.0,
        "block": list(DEFAULT_BLOCK),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "world_size": world,
        "layout": args.layout if world > 1 else None,
        "threads": args.threads,
        "timeout": args.timeout,
        "parent": os.getpid(),
        "run": run,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m`` this module: the same program as ``octlm bench`` with this suite."""
    return suites.run_program(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
