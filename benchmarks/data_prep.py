"""octlm's preparation of a corpus against a plain ``tokenizers`` ``encode_batch`` over the same
texts: MB/s and peak resident memory of each, each in a process of its own.

    .venv/bin/python benchmarks/data_prep.py [--size MB] [--output FILE] [--corpus FILE]
    .venv/bin/python benchmarks/data_prep.py --size MB --text FILE

``--text`` only writes a TinyStories-shaped text file of the same documents (between
``<|endoftext|>`` lines), for measuring ``octlm train --data FILE`` (docs/training.md).

The corpus is a generated JSON Lines file of ``--size`` MB (FineWeb-shaped: one document per
record, Zipf-drawn made-up words of one to four syllables, some multi-byte) under the system's
temporary folder, or ``--corpus``. One BPE of 4,096 tokens is learned from its first 10,000 records;
then, in separate processes, the raw rate (read each line, ``json.loads``, ``encode_batch`` in
batches of about 1 MB, ids dropped), the same with ``encode_batch_fast`` (no offsets, which
octlm uses) and octlm's (``write_tokens``: the same reading, the
split, encoding and the token files written). The record (appended to ``--output``, default
``runs/checks/data_prep.jsonl``) names the CPU and the load average before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH_BYTES = 1 << 20
VOCAB = 4096


def generate(path: Path, size: int, text: bool = False) -> None:
    """A JSON Lines file of about ``size`` bytes of documents of 60 to 600 words; with
    ``text``, a text file of them written as TinyStories is, between ``<|endoftext|>`` lines."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "us", "é"]
    syllables += ["ü", "中", "th", "st", "ing"]
    words = list({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(60000)})
    words.sort()
    weights = [1 / (rank + 10) for rank in range(len(words))]
    with path.open("w") as out:
        while out.tell() < size:
            lines = []
            for index in range(1000):
                story = " ".join(rng.choices(words, weights, k=rng.randint(60, 600))) + ".\n"
                record = {"id": index, "text": story}
                lines.append(f"{story}<|endoftext|>\n" if text else json.dumps(record) + "\n")
            out.write("".join(lines))


def raw(corpus: Path, tokenizer_file: Path, method: str = "encode_batch") -> dict:
    """A plain ``encode_batch`` (or ``method``) over the corpus's texts, read and parsed the
    same way."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    encode = getattr(tokenizer, method)
    texts, pending, size, tokens = [], 0, 0, 0
    start = time.perf_counter()
    with corpus.open("rb") as lines:
        for line in lines:
            text = json.loads(line)["text"]
            texts.append(text)
            pending += len(text)
            if pending >= BATCH_BYTES:
                tokens += sum(len(e.ids) for e in encode(texts))
                size += sum(len(t.encode()) for t in texts)
                texts, pending = [], 0
    tokens += sum(len(e.ids) for e in encode(texts))
    size += sum(len(t.encode()) for t in texts)
    return {"seconds": time.perf_counter() - start, "bytes": size, "tokens": tokens}


def octlm(corpus: Path, tokenizer_file: Path) -> dict:
    """octlm's preparation: every record split, encoded and written to token files."""
    from octlm.tokenizer import BPETokenizer
    from octlm.training.corpus import Corpus
    from octlm.training.tokens import write_tokens

    tokenizer = BPETokenizer.from_file(tokenizer_file)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        summary = write_tokens(Corpus.open(corpus, "*", 0.1), folder, tokenizer)
        seconds = time.perf_counter() - start
    size = summary["train_bytes"] + summary["val_bytes"]
    return {
        "seconds": seconds,
        "bytes": size,
        "tokens": summary["train_tokens"] + summary["val_tokens"],
    }


def measured(kind: str, corpus: Path, tokenizer_file: Path) -> dict:
    """One side's figures from a process of its own, with its peak resident memory."""
    command = [sys.executable, __file__, "--side", kind, "--corpus", str(corpus)]
    command += ["--tokenizer", str(tokenizer_file)]
    found = subprocess.run(command, capture_output=True, text=True, check=True)
    record = json.loads(found.stdout)
    record["mb_per_second"] = record["bytes"] / record["seconds"] / 1e6
    return record


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: its own since exec, where
    getrusage's would carry the parent's from before it)."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def load() -> str:
    """The load averages over 1, 5 and 15 minutes."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1000, help="MB of generated JSON Lines")
    parser.add_argument("--corpus", type=Path, help="a JSON Lines file instead")
    parser.add_argument("--text", type=Path, help="only write TinyStories-shaped text here")
    parser.add_argument("--output", type=Path, default=Path("runs/checks/data_prep.jsonl"))
    parser.add_argument("--side", choices=["raw", "raw-fast", "octlm"], help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # one measured side, in its own process
        sides = {"raw": raw, "octlm": octlm}
        sides["raw-fast"] = lambda *paths: raw(*paths, method="encode_batch_fast")
        record = sides[args.side](args.corpus, args.tokenizer)
        record["peak_rss_mb"] = peak_rss() / 2**20
        print(json.dumps(record))
        return
    if args.text:
        generate(args.text, args.size * 10**6, text=True)
        return
    from octlm import records
    from octlm.tokenizer import BPETokenizer

    with tempfile.TemporaryDirectory() as scratch:
        corpus = args.corpus or Path(scratch) / "corpus.jsonl"
        if args.corpus is None:
            generate(corpus, args.size * 10**6)
        with corpus.open("rb") as lines:
            head = [json.loads(line)["text"].encode() for line in itertools.islice(lines, 10000)]
        BPETokenizer.train(head, VOCAB).save(scratch)
        tokenizer_file = Path(scratch) / "tokenizer.json"
        before = load()
        record = records.make("check", "data-prep", corpus_mb=round(corpus.stat().st_size / 1e6, 1))
        record["raw"] = measured("raw", corpus, tokenizer_file)
        record["raw_fast"] = measured("raw-fast", corpus, tokenizer_file)
        record["octlm"] = measured("octlm", corpus, tokenizer_file)
        record |= {"load_before": before, "load_after": load()}
    for side in ("raw", "raw_fast"):
        rate = record["octlm"]["mb_per_second"] / record[side]["mb_per_second"]
        record[f"ratio_to_{side}"] = round(rate, 3)
    print(json.dumps(record))
    records.append(args.output, record)


if __name__ == "__main__":
    main()
