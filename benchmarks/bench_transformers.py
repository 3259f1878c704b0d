"""Prefill and decode speed, and peak memory, of a small transformers Llama with octlm's tiled
attention against transformers' own SDPA attention, at long contexts on this machine.

    .venv/bin/python benchmarks/bench_transformers.py            # 4,096 and 16,384 tokens, 3 rounds

Every measurement runs in a fresh process (``ru_maxrss`` is a lifetime peak, so processes
must not share one), and the implementations are interleaved: each round measures every
(length, implementation) pair, in reversed order on odd rounds, so that load from other work on a
shared machine falls on both alike. One JSON record per measurement is appended to ``--output`` (the
fields of docs/design.md, 'Records', plus the ones below); ``--summary`` prints medians.

A measurement: build the model (float32, batch 1, random weights and tokens), warm up on a
short prompt, take the memory baseline, prefill ``length`` tokens into a dynamic cache (only
the last position's logits are computed), then greedily decode ``--decode`` tokens one at a
time from that cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

import torch

from octlm import memory, records
from octlm.lab.bench.timing import time_calls

EXPERIMENT = "transformers-llama"
# A small Llama: 2 layers, width 256, 4 query heads of 64 sharing 2 key/value heads.
MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
)  # fmt: skip


def measure(attn: str, length: int, decode: int) -> dict:
    """One measurement in this process; returns its record."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from octlm.integrations.transformers import register

    register()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    tokens = torch.randint(0, config.vocab_size, (1, length))
    with torch.inference_mode():
        model(input_ids=tokens[:, :64], logits_to_keep=1)  # first-call costs, untimed
        baseline = memory.baseline("cpu")
        cache = DynamicCache(config=config)
        logits = []

        def fill() -> None:
            logits.append(model(input_ids=tokens, cache=cache, logits_to_keep=1).logits)

        prefill = sum(time_calls(fill, 1).seconds)  # logits (1, 1, V)
        prefill_peak = memory.peak("cpu")

        def step() -> None:
            token = logits[-1][:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
            logits.append(model(input_ids=token, cache=cache, logits_to_keep=1).logits)

        decoding = sum(time_calls(step, decode).seconds)
    peak = memory.peak("cpu")
    return {
        **records.make("check", EXPERIMENT),
        "transformers": sys.modules["transformers"].__version__,
        "attn": attn,
        "length": length,
        "decode_tokens": decode,
        "dtype": "float32",
        "batch": 1,
        **{key: MODEL[key] for key in ("num_hidden_layers", "hidden_size")},
        "heads": MODEL["num_attention_heads"],
        "kv_heads": MODEL["num_key_value_heads"],
        "status": "ok",
        "prefill_seconds": prefill,
        "prefill_tokens_per_s": length / prefill,
        "decode_seconds": decoding,
        "decode_tokens_per_s": decode / decoding,
        "memory_metric": memory.metric("cpu"),
        "baseline_bytes": baseline,
        "prefill_peak_bytes": prefill_peak,
        "peak_bytes": peak,
        "extra_bytes": peak - baseline,
        "pid": os.getpid(),
    }


def run(args: argparse.Namespace) -> None:
    """Spawn one worker per measurement, interleaved, and append their records."""
    pairs = [(length, attn) for length in args.lengths for attn in args.attn]
    for round_ in range(args.rounds):
        for length, attn in pairs if round_ % 2 == 0 else pairs[::-1]:
            command = [sys.executable, __file__, "--worker", attn, str(length), str(args.decode)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                record = (
                    json.loads(done.stdout.strip().splitlines()[-1])
                    if done.returncode == 0
                    else failed(attn, length, "error", done.stderr.strip()[-500:])
                )
            except subprocess.TimeoutExpired:
                record = failed(attn, length, "timeout", f"over {args.timeout} s")
            record["round"] = round_
            records.append(args.output, record)
            print(summary_line(record), flush=True)


def failed(attn: str, length: int, status: str, reason: str) -> dict:
    return {**records.make("check", EXPERIMENT), "attn": attn, "length": length, "status": status,
            "reason": reason}  # fmt: skip


def summary_line(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['attn']:>12} {record['length']:>6}  {record['status']}: {record['reason']}"
    return (
        f"{record['attn']:>12} {record['length']:>6}  prefill {record['prefill_tokens_per_s']:8.0f}"
        f" tok/s  decode {record['decode_tokens_per_s']:6.1f} tok/s  peak "
        f"{record['peak_bytes'] / 2**20:6.0f} MiB (+{record['extra_bytes'] / 2**20:.0f})"
    )


def summarise(path: str) -> None:
    """Median (min-max) of every figure, per (length, implementation), as a Markdown table."""
    groups = defaultdict(list)
    for record in records.read(path):
        if record.get("experiment") == EXPERIMENT and record["status"] == "ok":
            groups[record["length"], record["attn"]].append(record)
    columns = (  # (heading, field, scale, format)
        ("prefill tok/s", "prefill_tokens_per_s", 1, ",.0f"),
        ("decode tok/s", "decode_tokens_per_s", 1, ".1f"),
        ("peak RSS MiB", "peak_bytes", 2**20, ",.0f"),
        ("added MiB", "extra_bytes", 2**20, ",.0f"),
    )
    print("| context | attention | runs | " + " | ".join(c[0] for c in columns) + " |")
    print("|---:|---|---:|" + "---|" * len(columns))
    for (length, attn), group in sorted(groups.items()):
        cells = []
        for _, field, scale, spec in columns:
            values = [r[field] / scale for r in group]
            low, middle, high = min(values), statistics.median(values), max(values)
            cells.append(f"{middle:{spec}} ({low:{spec}}-{high:{spec}})")
        print(f"| {length:,} | {attn} | {len(group)} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--attn", nargs="+", default=["sdpa", "octlm_tiled"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded after prefill")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument("--output", default="runs/checks/bench-transformers.jsonl")
    parser.add_argument("--summary", action="store_true", help="only print medians of --output")
    parser.add_argument("--worker", nargs=3, metavar=("ATTN", "LENGTH", "DECODE"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        attn, length, decode = args.worker
        print(json.dumps(measure(attn, int(length), int(decode))))
    elif args.summary:
        summarise(args.output)
    else:
        run(args)
        summarise(args.output)


if __name__ == "__main__":
    main()
