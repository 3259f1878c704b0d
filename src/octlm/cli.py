"""``octlm verify | bench | report``: argument parsing only; the work is in the library."""

from __future__ import annotations

import argparse
import sys


def _verify_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm verify`` (owned by the verify work)."""
    parser.set_defaults(run=lambda args: _not_ready("verify"))


def _bench_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm bench`` (owned by the bench work)."""
    parser.set_defaults(run=lambda args: _not_ready("bench"))


def _report_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm report`` (owned by the report work)."""
    parser.set_defaults(run=lambda args: _not_ready("report"))


def _not_ready(name: str) -> int:
    print(f"octlm {name}: not built yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="octlm", description="Exact attention three ways, checked and measured."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _verify_parser(commands.add_parser("verify", help="equivalence experiments -> runs/*.jsonl"))
    _bench_parser(commands.add_parser("bench", help="one process per measurement -> runs/"))
    _report_parser(commands.add_parser("report", help="tables and plots from records"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
