"""``octlm bench GRID``: a grid suite's command line, its options and the run they start.

Each option replaces a field in every grid of the chosen suite (:data:`GRID_OPTIONS`); the
program suites (:data:`octlm.lab.bench.suites.PROGRAMS`) have a module each with the same two
functions.
"""

from __future__ import annotations

import argparse

from octlm.lab.bench.suites import (
    BACKENDS,
    DTYPES,
    FEATURES,
    GRID_OPTIONS,
    MODES,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of a grid suite: grid overrides, rounds, output."""
    grid = parser.add_argument_group("grid (default: the suite's)")
    grid.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        metavar="NAME",
        help=f"among {', '.join(BACKENDS)}",
    )
    grid.add_argument(
        "--modes", nargs="+", choices=MODES, help="forward, or train (forward + backward)"
    )
    grid.add_argument("--lengths", nargs="+", type=int, metavar="T", help="key lengths")
    grid.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, metavar="DTYPE", help=f"among {', '.join(DTYPES)}"
    )
    grid.add_argument("--batch", type=int)
    grid.add_argument("--heads", type=int, help="query heads")
    grid.add_argument("--kv-heads", type=int, dest="kv_heads", help="key/value heads")
    grid.add_argument("--head-size", nargs="+", type=int, dest="head_sizes", metavar="D")
    grid.add_argument("--causal", action=argparse.BooleanOptionalAction)
    grid.add_argument(
        "--window",
        nargs="+",
        type=int,
        dest="windows",
        metavar="W",
        help="sliding window (0 = none)",
    )
    grid.add_argument(
        "--q-len",
        nargs="+",
        type=int,
        dest="q_lens",
        metavar="Q",
        help="new queries against a cache of LENGTH keys (bottom-right causal)",
    )
    grid.add_argument(
        "--padding",
        nargs="+",
        type=float,
        dest="paddings",
        metavar="F",
        help="fraction of keys that are padding (key_lengths)",
    )
    grid.add_argument(
        "--features",
        nargs="+",
        type=lambda name: None if name == "none" else name,
        choices=[*FEATURES, None],
        metavar="NAME",
        help=f"structure or score keyword to add: {', '.join(FEATURES)}, or none",
    )
    grid.add_argument(
        "--block", nargs="+", type=int, metavar="B", help="tiled's block: B, or BLOCK_Q BLOCK_K"
    )
    grid.add_argument("--repeats", type=int, help="timed calls per measurement")
    grid.add_argument("--device", help="cpu or cuda")
    grid.add_argument(
        "--busy",
        action="store_const",
        const=(False, True),
        help="measure every point twice, idle and beside one CPU-bound competing process that "
        "the benchmark starts and stops",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the grid this many times, one fresh process per measurement, backends "
        "alternating (default 1)",
    )
    parser.add_argument(
        "--no-peak",
        dest="peak",
        action="store_false",
        help="skip the float32 matrix-multiply probe that starts each run (a few seconds)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per measurement before its worker is killed (default 600)",
    )
    parser.add_argument(
        "--output", help="records file (default runs/local/bench-SUITE-DEVICE.jsonl)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip measurements already recorded ok, skipped or unsupported",
    )


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Measure the suite ``args.suite`` with the grid options given, one process each."""
    from octlm.lab.bench.driver import bench

    grid_options = {option: getattr(args, option) for option in GRID_OPTIONS}
    return bench(
        args.suite,
        output=args.output,
        timeout=args.timeout,
        resume=args.resume,
        rounds=args.rounds,
        peak=args.peak,
        **grid_options,
    )
