"""How long the data path takes to start: ``octlm prepare`` (fresh, then up to date) and a new
``octlm train --steps 1`` run (a BPE of 512 tokens, to its first step and
out), on a corpus of many small JSON Lines files and on one of many records with empty text.

    .venv/bin/python benchmarks/data_start.py [--rounds 3] [--files 20000] [--records 200000]
        [--before SRC] [--output FILE]

``--before SRC`` (the ``src`` folder of another checkout, such as a ``git worktree`` of an
earlier commit) times that code too, with the same interpreter: each round runs every
command under both, alternating which goes first, each in a fresh process. The corpora are
generated under a temporary folder and removed. One JSON record per command and round; the
summary is each command's median wall time and its spread under each code.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from octlm import records

TINY = ["--width", "16", "--n-layers", "1", "--n-heads", "2", "--length", "16", "--batch", "4"]
TINY += ["--eval-batches", "1", "--sample-tokens", "0", "--tokenizer", "bpe", "--vocab-size", "512"]


def write_corpora(root: Path, files: int, empty_records: int) -> dict[str, Path]:
    """The two corpora: ``files`` JSON Lines files of a few records each, and one file of
    ``empty_records`` records, two in three of them with an empty text field."""
    generator = random.Random(0)
    words = [f"w{index}" for index in range(3000)]

    def record(empty: bool = False) -> str:
        text = "" if empty else " ".join(generator.choices(words, k=generator.randint(5, 30)))
        return json.dumps({"text": text}) + "\n"

    many = root / "many-files"
    for index in range(files):
        folder = many / f"{index // 1000:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.jsonl").write_text("".join(record() for _ in range(3)))
    empty = root / "empty-records.jsonl"
    with empty.open("w") as out:
        for index in range(empty_records):
            out.write(record(empty=index % 3 != 0))
    return {"many-files": many, "empty-records": empty}


def timed(command: list[str], src: Path | None) -> float:
    """Wall seconds of ``python -m octlm COMMAND`` in a fresh process, with ``src`` first on
    the import path where given."""
    environment = dict(os.environ)
    if src is not None:
        environment["PYTHONPATH"] = str(src)
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "octlm", *command], capture_output=True, text=True, env=environment
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"octlm {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--before", type=Path, help="the src folder of the code to compare")
    parser.add_argument("--output", type=Path, default=Path("runs/checks/data-start.jsonl"))
    args = parser.parse_args()
    codes = {"after": None} | ({"before": args.before.resolve()} if args.before else {})
    found: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        corpora = write_corpora(root, args.files, args.records)
        for round_ in range(args.rounds):
            order = list(codes) if round_ % 2 == 0 else list(codes)[::-1]
            for corpus_name, corpus in corpora.items():
                for code in order:
                    tokens, run = root / f"tokens-{code}", root / f"run-{code}"
                    shutil.rmtree(tokens, ignore_errors=True)
                    shutil.rmtree(run, ignore_errors=True)
                    prepare = ["prepare", "--data", str(corpus), "--out", str(tokens)]
                    prepare += ["--tokenizer", "bpe", "--vocab-size", "512"]
                    train = ["train", "--data", str(corpus), "--out", str(run), "--steps", "1"]
                    for what, command in (
                        ("prepare fresh", prepare),
                        ("prepare up to date", prepare),
                        ("train --steps 1", [*train, *TINY]),
                    ):
                        seconds = timed(command, codes[code])
                        found.setdefault((corpus_name, what, code), []).append(seconds)
                        record = records.make(
                            "check",
                            "data-start",
                            corpus=corpus_name,
                            files=args.files,
                            records=args.records,
                            what=what,
                            code=code,
                            round=round_,
                            seconds=seconds,
                            command="octlm " + " ".join(command),
                        )
                        records.append(args.output, record)
    for (corpus_name, what, code), seconds in sorted(found.items()):
        print(
            f"{corpus_name:14} {what:20} {code:6} median {statistics.median(seconds):6.2f} s "
            f"({min(seconds):.2f}-{max(seconds):.2f}, {len(seconds)} rounds)"
        )


if __name__ == "__main__":
    main()
