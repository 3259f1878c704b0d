"""What the octlm train tests share: a tiny model and run, generated corpora, record readers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

from octlm.model import ModelConfig
from octlm.training import checkpoint, tokens
from octlm.training.config import RunConfig, resolve
from octlm.training.corpus import Corpus
from octlm.training.metrics import METRICS

TINY_MODEL = dict(width=16, n_layers=1, n_heads=2, n_kv_heads=1)
# float32 on every machine (--dtype auto would pick bfloat16 on one with bfloat16 units): the
# tests compare losses exactly.
TINY_RUN = dict(
    steps=6, batch=4, length=16, eval_every=3, eval_batches=2, checkpoint_every=2, keep=10,
    log_every=1, sample_tokens=4, warmup=2, lr=1e-2, dtype="float32", tokenizer="bytes",
    optimizer="adamw",
)  # fmt: skip


def write_corpus(folder: Path, documents: int = 12, size: int = 600) -> Path:
    """A folder of ``documents`` text files of Python-like lines, in two sub-folders."""
    generator = torch.Generator().manual_seed(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n    ", b"import ", b"0", b"1"]
    for index in range(documents):
        picks = torch.randint(len(words), (size,), generator=generator).tolist()
        text = b"".join(words[i] for i in picks)[:size]
        path = folder / f"part{index % 2}" / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
    return folder


def write_short_documents(folder: Path) -> Path:
    """40 documents of 2 to 40 bytes: packed rows of 16 hold several, and padding."""
    write_corpus(folder, documents=40, size=40)
    for index, path in enumerate(sorted(folder.rglob("*.txt"))):
        path.write_bytes(path.read_bytes()[: 2 + index * 7 % 39])
    return folder


def configs(corpus: Path, **run) -> tuple[ModelConfig, RunConfig]:
    return resolve(model=TINY_MODEL, run={**TINY_RUN, "data": str(corpus), **run})


def read_metrics(folder: Path, kind: str) -> list[dict]:
    lines = (folder / METRICS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder, "train_step")}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint.listed(folder)}


def flip_a_weight_bit(path: Path) -> bytes:
    """The checkpoint's bytes with one bit of its first weight flipped: still a valid file."""
    content = path.read_bytes()
    state = torch.load(path, weights_only=True)["model"]
    weight = next(value for value in state.values() if isinstance(value, torch.Tensor))
    at = content.index(weight.numpy().tobytes()[:64]) + 3
    return content[:at] + bytes([content[at] ^ 0x40]) + content[at + 1 :]


def tiny_flags(corpus: Path, folder: Path, steps: int) -> list[str]:
    return [
        "train", "--data", str(corpus), "--out", str(folder), "--steps", str(steps),
        "--width", "16", "--n-layers", "1", "--n-heads", "2", "--batch", "4", "--length", "16",
        "--eval-every", "100000", "--checkpoint-every", "100000", "--log-every", "1",
        "--eval-batches", "1", "--sample-tokens", "4", "--dtype", "float32",
        "--tokenizer", "bytes", "--optimizer", "adamw",
    ]  # fmt: skip


def octlm(*arguments, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m octlm ARGUMENTS`` in a process of its own, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "octlm", *map(str, arguments)],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def write_tokens(path, glob, val_share, folder, tokenizer=None, *, formats=None) -> dict:
    """The corpus at ``path`` opened and its token files written into ``folder``."""
    return tokens.write_tokens(Corpus.open(path, glob, val_share, formats), folder, tokenizer)
