"""Packed documents: tiled attention's block skipping against SDPA and FlexAttention on CPU.

    octlm bench documents                   # 8,192 tokens in 8 documents of 1,024
    octlm bench documents --length 1024 --documents 4 --output /tmp/d.jsonl

(``python -m octlm.lab.bench.documents`` is the same program.)

One process, fp32, causal. Backends are interleaved (each round runs every backend once, in
turn), so a change in the machine's load falls on all of them alike; each figure is the median
over the rounds, with the spread (max - min) beside it. Every call includes its own mask
work: ``tiled`` decides the skipped blocks from ``document_ids`` inside the call, ``sdpa``
(forced onto its FLASH backend) builds the dense ``(B, 1, T, T)`` document mask in the call,
``tiled block_mask`` builds ``block_mask(document_mod(...))`` in the call,
and ``flex`` (``torch.nn.attention.flex_attention``, compiled, forward only: it has no CPU
backward) adds the time of ``create_block_mask`` for the same ``mask_mod``, measured
separately. Compilation happens in a warm-up call and is not timed.

Each record carries the fields of docs/design.md, 'Records', the shape, ``seconds`` (every round),
``seconds_median``, ``seconds_spread`` and ``loadavg`` (``os.getloadavg()`` before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from octlm import records
from octlm.attention import block_mask, sdpa_attention, tiled_attention
from octlm.attention.block_masks import document_mod
from octlm.lab.bench import suites
from octlm.lab.bench.decode import positive_int
from octlm.lab.bench.timing import time_calls
from octlm.signals import run_stoppable

EXPERIMENT = "bench-documents"
OUTPUT = records.LOCAL / "bench-documents-cpu.jsonl"


def packed(length: int, documents: int) -> torch.Tensor:
    """Document ids ``(1, length)``: ``documents`` documents of equal length, in order."""
    return (torch.arange(length) * documents // length).unsqueeze(0)


def backends(query, key, value, ids, modes) -> dict[tuple[str, str], Callable[[], None]]:
    """One zero-argument call per (backend, mode), each doing all of its own mask work."""

    def tiled_forward():
        with torch.no_grad():
            tiled_attention(query, key, value, document_ids=ids)

    def tiled_train():
        tiled_attention(query, key, value, document_ids=ids).sum().backward()

    def block_mask_forward():  # the same pattern as a block mask, built in the call
        length = ids.shape[1]
        mask = block_mask(document_mod(ids, length), 1, query.shape[1], length, length)
        with torch.no_grad():
            tiled_attention(query, key, value, causal=False, block_mask=mask)

    def sdpa_forward():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_attention(query, key, value, document_ids=ids)

    def sdpa_train():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_attention(query, key, value, document_ids=ids).sum().backward()

    calls = {
        ("tiled", "forward"): tiled_forward,
        ("tiled", "train"): tiled_train,
        ("tiled block_mask", "forward"): block_mask_forward,
        ("flash", "forward"): sdpa_forward,
        ("flash", "train"): sdpa_train,
    }
    return {case: call for case, call in calls.items() if case[1] in modes}


def flex_forward(query, key, value, ids) -> tuple[Callable[[], None], Callable[[], object]]:
    """FlexAttention's compiled forward over a prebuilt block mask, and the block-mask build."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    row_ids = ids[0]
    length = row_ids.shape[0]

    def document_causal(b, h, q_index, k_index):
        return (row_ids[q_index] == row_ids[k_index]) & (k_index <= q_index)

    def build():
        return create_block_mask(document_causal, 1, None, length, length, device="cpu")

    compiled = torch.compile(flex_attention)
    block_mask = build()

    def forward():
        with torch.no_grad():
            compiled(query, key, value, block_mask=block_mask)

    return forward, build


def measure(calls: dict, rounds: int) -> dict:
    """Every call once per round, in turn, after one untimed call each (compilation, allocator,
    caches); returns the seconds of each."""
    for call in calls.values():
        time_calls(call, 0, warmup=1)
    seconds = {case: [] for case in calls}
    for _ in range(rounds):
        for case, call in calls.items():
            seconds[case] += time_calls(call, 1).seconds
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options, on ``parser`` (its own, or ``octlm bench``'s subcommand)."""
    parser.add_argument("--length", type=positive_int, default=8192)
    parser.add_argument("--documents", type=positive_int, default=8)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--head-size", type=positive_int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument(
        "--modes", nargs="+", choices=["forward", "train"], default=["forward", "train"]
    )
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="intra-op threads (default: torch's); on a shared, oversubscribed machine 1 "
        "keeps thread synchronisation out of the figures",
    )
    parser.add_argument(
        "--output", type=Path, default=OUTPUT, help="records file (default %(default)s)"
    )


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The suite's exit status: 0, 1 when a record cannot be written, 128 + a stop signal."""
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3 for a median and a spread, got {args.rounds}")
    if args.documents > args.length:
        parser.error(f"--documents ({args.documents}) cannot exceed --length ({args.length})")
    try:  # the records are written at the end, after every round: check first that they can be
        records.check_writable(args.output, "--output")
    except ValueError as error:
        parser.error(str(error))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return run_stoppable(
        parser.prog,
        lambda: run(args),
        {OSError: 1},
        kept="no records: they are written once every round has run",
    )


def run(args: argparse.Namespace) -> None:
    """Measure every backend in interleaved rounds, then append one record per backend."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.length, args.head_size)
    query, key, value = (torch.randn(shape, generator=generator).requires_grad_() for _ in range(3))
    ids = packed(args.length, args.documents)
    load_before = os.getloadavg()
    calls = backends(query, key, value, ids, args.modes)
    build_seconds = None
    flex_status, flex_reason = "skipped", "--no-flex"
    if not args.no_flex and "forward" in args.modes:
        try:
            forward, build = flex_forward(query.detach(), key.detach(), value.detach(), ids)
            forward()  # compile once, outside the timing
            calls[("flex", "forward")] = forward
            calls[("flex mask", "build")] = build
            flex_status, flex_reason = "ok", None
        except Exception as error:  # FlexAttention needs a working compiler here
            flex_status, flex_reason = "error", f"{type(error).__name__}: {error}"[:500]
    seconds = measure(calls, args.rounds)
    load_after = os.getloadavg()
    if ("flex mask", "build") in seconds:
        build_seconds = seconds.pop(("flex mask", "build"))
    base = records.make("check", EXPERIMENT) | {
        "dtype": "float32",
        "batch": 1,
        "heads": args.heads,
        "head_size": args.head_size,
        "length": args.length,
        "documents": args.documents,
        "causal": True,
        "rounds": args.rounds,
        "loadavg": [list(load_before), list(load_after)],
    }
    for (backend, mode), times in seconds.items():
        if backend == "flex":  # the block mask is built once per mask; its time is added
            times = [t + b for t, b in zip(times, build_seconds, strict=True)]
        record = base | {
            "backend": backend,
            "mode": mode,
            "status": "ok",
            "seconds": times,
            "seconds_median": statistics.median(times),
            "seconds_spread": max(times) - min(times),
        }
        if backend == "flex":
            record["mask_build_seconds"] = build_seconds
        records.append(args.output, record)
        print(
            f"{backend:6s} {mode:8s} median {record['seconds_median']:.3f} s  "
            f"spread {record['seconds_spread']:.3f} s"
        )
    if flex_status != "ok":
        failed = {"backend": "flex", "mode": "forward", "status": flex_status}
        records.append(args.output, base | failed | {"reason": flex_reason})
        print(f"flex   forward  {flex_status}: {flex_reason}")
    print(f"load average before {load_before}, after {load_after}; wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    """``python -m`` this module: the same program as ``octlm bench`` with this suite."""
    return suites.run_program(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
