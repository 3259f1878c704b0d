"""Generation speed of the octlm model: tokens/s decoding after a long prompt, tiled vs sdpa.

    octlm bench decode                       # 1k, 8k and 32k context; 5 rounds
    octlm bench decode --contexts 256 --new-tokens 4 --rounds 2 --output /tmp/d.jsonl

(``python -m octlm.lab.bench.decode`` is the same program.)

For each context length, one model per attention implementation (the same weights). The
random prompt is prefilled once, by ``--prefill`` (sdpa by default), in chunks of ``--chunk``
tokens through a :class:`~octlm.model.KVCache` (timed: ``stage="prefill"``); a cache serves
every model of its config, whatever its attention. Decoding then runs in rounds from that
cache, rewound to the prompt before each run: every round decodes ``--new-tokens`` greedy
tokens with each implementation, in an order that alternates from round to round, so a change
in the machine's load falls on both (``stage="decode"``). Last, the attention call alone: one
query against the context's keys, as the cache hands them out and copied contiguous, timed
the same interleaved way (``stage="attention"``).

Every record carries the fields of docs/design.md, 'Records', that apply, the 1-minute load average
before and after the measurement and ``cpu_share`` (the process's CPU time over wall time,
per thread): on a shared machine, a figure taken while others ran says so itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from octlm import records
from octlm.attention import implementation
from octlm.attention.tiled.options import DEFAULT_BLOCK
from octlm.lab.bench import suites
from octlm.lab.bench.timing import Timing, time_calls
from octlm.model import KVCache, ModelConfig, OctLM
from octlm.signals import run_stoppable

EXPERIMENT = "bench-decode"
OUTPUT = records.LOCAL / "bench-decode-cpu.jsonl"
ATTENTIONS = ("tiled", "sdpa")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def prefill(model: OctLM, prompt: torch.Tensor, chunk: int) -> tuple[KVCache, torch.Tensor]:
    """A cache holding ``prompt (B, T)``, filled ``chunk`` tokens per call; the last logits."""
    cache = KVCache(model.config)
    for piece in prompt.split(chunk, dim=1):
        logits = model(piece, cache=cache)[:, -1]  # (B, V)
    return cache, logits


def decode(
    model: OctLM, cache: KVCache, logits: torch.Tensor, new_tokens: int
) -> tuple[Timing, torch.Tensor]:
    """Greedy tokens ``(B, new_tokens)``, one model call each, and the timing of each call
    (the call and the argmax that picks its token)."""
    tokens, last = [], [logits]

    def step() -> None:
        tokens.append(last[-1].argmax(dim=-1, keepdim=True))  # (B, 1)
        last.append(model(tokens[-1], cache=cache)[:, -1])  # (B, V)

    return time_calls(step, new_tokens), torch.cat(tokens, dim=1)


def attention_alone(
    name: str, config: ModelConfig, cache: KVCache, layout: str, repeats: int
) -> Timing:
    """``repeats`` attention calls of one query against the cache's first layer, after one
    untimed call: its keys as the cache hands them out (``layout="cache"``, a view of the
    buffer) or copied into a contiguous tensor (``"contiguous"``)."""
    impl = implementation(name)
    key, value = cache.keys[0], cache.values[0]  # (B, Hkv, K, D) each
    if layout == "contiguous":
        key, value = key.contiguous(), value.contiguous()  # (B, Hkv, K, D) each
    query = torch.randn(key.shape[0], config.n_heads, 1, config.head_size, dtype=key.dtype)
    tuning = {option: getattr(config, option) for option in impl.tuning if hasattr(config, option)}

    def call() -> None:
        impl.function(query, key, value, causal=True, window=config.window, **tuning)

    return time_calls(call, repeats, warmup=1)


def load_fields(timing: Timing) -> dict:
    """How busy the machine was around a measurement: the load average before and after, and
    the CPU share each thread got."""
    rounded = {
        name: None if value is None else round(value, 2)
        for name, value in (
            ("loadavg_before", timing.load_before),
            ("loadavg_after", timing.load_after),
        )
    }
    return {**rounded, "cpu_share": round(timing.cpu_share(torch.get_num_threads()), 3)}


def alternating(round_: int) -> tuple[str, ...]:
    """The implementations in this round's order: reversed every other round."""
    return ATTENTIONS if round_ % 2 == 0 else ATTENTIONS[::-1]


def run(args: argparse.Namespace) -> list[dict]:
    """Every measurement in the order taken; each record is appended as soon as it exists."""
    generator = torch.Generator().manual_seed(0)
    written = []
    for context in args.contexts:
        written += measure(args, context, generator)
    return written


def measure(args: argparse.Namespace, context: int, generator: torch.Generator) -> list[dict]:
    """Prefill, decoding rounds and attention alone at one context length."""
    config = ModelConfig(
        n_kv_heads=args.kv_heads, max_length=context + args.new_tokens, block=args.block
    )
    torch.manual_seed(0)
    weights = OctLM(config).state_dict()
    models = {}
    for name in ATTENTIONS:
        models[name] = OctLM(replace(config, attention=name)).eval()
        models[name].load_state_dict(weights)
    prompt = torch.randint(config.vocab_size, (args.batch, context), generator=generator)
    written = []

    def write(stage: str, name: str, timing: Timing, **fields) -> None:
        record = {
            **records.make("check", EXPERIMENT),
            "stage": stage,
            "attention": name,
            "context": context,
            "batch": args.batch,
            "dtype": "float32",
            **{key: value for key, value in asdict(config).items() if key != "attention"},
            "head_size": config.head_size,
            **load_fields(timing),
            **fields,
            "pid": os.getpid(),
        }
        records.append(args.output, record)
        written.append(record)

    with torch.inference_mode():
        filled = []  # the prefill's cache and last logits
        timing = time_calls(
            lambda: filled.append(prefill(models[args.prefill], prompt, args.chunk)), 1
        )
        [(cache, logits)] = filled
        seconds = timing.seconds[0]
        write(
            "prefill",
            args.prefill,
            timing,
            chunk=args.chunk,
            seconds=seconds,
            tokens_per_second=context * args.batch / seconds,
        )
        for round_ in range(args.rounds):
            for name in alternating(round_):
                cache.length = context  # rewind: the decoded positions get overwritten
                timing, tokens = decode(models[name], cache, logits, args.new_tokens)
                per_token = records.timing(timing.seconds)
                write(
                    "decode",
                    name,
                    timing,
                    round=round_,
                    new_tokens=args.new_tokens,
                    seconds=sum(timing.seconds),
                    seconds_per_token_median=per_token["seconds_median"],
                    seconds_per_token_iqr=per_token["seconds_iqr"],
                    seconds_per_token=timing.seconds,
                    tokens_per_second=args.new_tokens * args.batch / sum(timing.seconds),
                    tokens=tokens.tolist(),
                )
        cache.length = context
        for round_ in range(args.rounds):
            for layout in ("cache", "contiguous"):
                for name in alternating(round_):
                    timing = attention_alone(name, config, cache, layout, args.repeats)
                    write(
                        "attention",
                        name,
                        timing,
                        round=round_,
                        layout=layout,
                        q_len=1,
                        k_len=context,
                        repeats=args.repeats,
                        **records.timing(timing.seconds),
                    )
    return written


def report(written: list[dict]) -> str:
    """One line per context and measurement: each implementation's median over rounds, and the
    per-round ratio of tiled's time to sdpa's (median, min, max)."""
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for r in written:
        if r["stage"] != "prefill":
            key = (r["context"], r["stage"], r.get("layout"))
            groups.setdefault(key, {}).setdefault(r["round"], {})[r["attention"]] = r
    lines = []
    for (context, stage, layout), rounds in groups.items():
        decoding = stage == "decode"
        field = "seconds" if decoding else "seconds_median"
        ratios = [pair["tiled"][field] / pair["sdpa"][field] for pair in rounds.values()]
        shown = []
        for name in ATTENTIONS:
            if decoding:
                rate = statistics.median(
                    pair[name]["tokens_per_second"] for pair in rounds.values()
                )
                shown.append(f"{name} {rate:.1f} tok/s")
            else:
                seconds = statistics.median(pair[name][field] for pair in rounds.values())
                shown.append(f"{name} {seconds * 1e3:.3f} ms")
        if decoding:
            same = all(
                pair["tiled"]["tokens"] == pair["sdpa"]["tokens"] for pair in rounds.values()
            )
            note = f"same tokens: {same}"
        else:
            fastest = {
                name: min(min(pair[name]["seconds"]) for pair in rounds.values())
                for name in ATTENTIONS
            }
            note = f"{layout} keys; fastest call " + ", ".join(
                f"{name} {seconds * 1e3:.3f} ms" for name, seconds in fastest.items()
            )
        load = statistics.median(
            r["loadavg_before"] for pair in rounds.values() for r in pair.values()
        )
        lines.append(
            f"{context:>6} {stage:<9} {', '.join(shown)}; tiled/sdpa time median "
            f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}, "
            f"{len(ratios)} rounds); load {load:.1f}; {note}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options, on ``parser`` (its own, or ``octlm bench``'s subcommand)."""
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--new-tokens", type=positive_int, default=16, help="per round")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--repeats", type=positive_int, default=20, help="attention calls alone")
    parser.add_argument("--chunk", type=positive_int, default=1024, help="prefill chunk")
    parser.add_argument("--prefill", choices=ATTENTIONS, default="sdpa", help="prefills the cache")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--block", type=positive_int, nargs=2, default=list(DEFAULT_BLOCK))
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument(
        "--output", type=Path, default=OUTPUT, help="records file (default %(default)s)"
    )


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The suite's exit status: 0, 1 when a record cannot be written, 128 + a stop signal."""
    args.block = tuple(args.block)
    try:
        ModelConfig(n_kv_heads=args.kv_heads, block=args.block)  # a bad size fails here
    except ValueError as error:
        parser.error(f"--kv-heads or --block: {error}")
    try:  # an unwritable output fails here, before the measurements
        records.check_writable(args.output, "--output")
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    return run_stoppable(
        parser.prog,
        lambda: print(report(run(args))),
        {OSError: 1},
        kept=f"finished records are in {args.output}",
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m`` this module: the same program as ``octlm bench`` with this suite."""
    return suites.run_program(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
