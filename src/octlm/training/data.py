"""Training data: text files -> one token file per split, memory-mapped.

A corpus is one text file or a folder of files matched by a recursive glob; each file is a
document. A document goes to validation when a hash of its path (relative to the corpus root)
falls below the validation share, so the split is the same on every machine and in every run,
whatever order the files are found in. A single file is one document: its last ``val_share`` of
bytes is held out instead.

Tokens are the bytes themselves (vocabulary 256), or the ids of the run's BPE
(:mod:`octlm.tokenizer`), which encodes each document on its own, so documents start on token
boundaries, and ends each with its end-of-text token (the head of a single file held out at its
tail is no end, and gets none); a window of the token stream that straddles two documents sees
where one ends, and a packed row predicts its documents' ends. They are written once to
``train.bin`` and ``val.bin`` as unsigned ints of the smallest width that holds the vocabulary
(uint8 for bytes, uint16 up to 65,536 tokens; the dtype is in ``data.json``) and read back
with ``torch.from_file``, a memory map: a corpus larger than memory costs only the pages that
batches touch. Beside each, ``train.starts.bin``
and ``val.starts.bin`` hold where each document starts (int64 offsets, in tokens), for packed
batches.

A batch's rows are either random windows of the token stream (``Batches``), which may straddle
documents, or whole documents packed into rows and kept apart by ``document_ids``
(``PackedBatches``, ``octlm train --pack``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from octlm.tokenizer import MAX_VOCAB, BPETokenizer, ByteTokenizer

SPLITS = ("train", "val")
DEFAULT_GLOB = "**/*.txt"
STDLIB_GLOB = "**/*.py"
# Installed packages are not the standard library, wherever an interpreter keeps them.
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})
SUMMARY = "data.json"
STARTS = "{split}.starts.bin"
# Every file write_tokens may leave in its folder: a folder of nothing else is octlm's own.
OWN_FILES = frozenset(
    {SUMMARY}
    | {name.format(split=split) for split in SPLITS for name in ("{split}.bin", STARTS)}
    | {f".{split}.bin.tmp" for split in SPLITS}
)
IGNORED = -100  # a target that counts for nothing (F.cross_entropy's default ignore_index)
# Token file dtypes, narrowest first, and the array typecode of each width.
DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32}
TYPECODES = {1: "B", 2: "H", 4: next(code for code in "IL" if array(code).itemsize == 4)}


def default_corpus() -> tuple[Path, str]:
    """The running interpreter's standard library sources: real text on every machine."""
    return Path(sysconfig.get_paths()["stdlib"]), STDLIB_GLOB


def token_dtype(vocab_size: int) -> str:
    """The narrowest token file dtype that holds every id below ``vocab_size``."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, 2**32] for token files, got {vocab_size}")
    return next(name for name, dtype in DTYPES.items() if vocab_size - 1 <= torch.iinfo(dtype).max)


def find_documents(path: str | os.PathLike, glob: str) -> list[Path]:
    """The files of a corpus, sorted: ``path`` itself, or the files under it matching ``glob``."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data {str(path)!r} does not exist: expected a text file or a folder")
    if path.is_file():
        return [path]
    files = sorted(
        file
        for file in path.glob(glob)
        if file.is_file() and not SKIPPED_FOLDERS.intersection(file.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"data folder {str(path)!r} has no file matching glob {glob!r}")
    return files


def path_fraction(relative: Path) -> float:
    """A document's place in [0, 1): the hash of its path relative to the corpus root."""
    # fsencode: a name that is not UTF-8 hashes as its own bytes, a UTF-8 one as its encoding
    digest = hashlib.sha256(os.fsencode(relative.as_posix())).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def held_out(relatives: list[Path], val_share: float) -> set[Path]:
    """The documents whose path fraction falls below ``val_share``.

    A small corpus may get none (or only held-out ones); then the document nearest the cut
    crosses over, so that both sides have one whenever there are two documents.
    """
    ranked = sorted(relatives, key=path_fraction)
    chosen = {r for r in ranked if path_fraction(r) < val_share}
    if len(ranked) >= 2 and not chosen:
        chosen = {ranked[0]}
    if len(ranked) >= 2 and len(chosen) == len(ranked):
        chosen.discard(ranked[-1])
    return chosen


def _corpus(path: str | os.PathLike, glob: str, val_share: float):
    """The corpus root, its documents, and those of them held out (none for a single file)."""
    path = Path(path)
    documents = find_documents(path, glob)
    validation = (
        held_out([d.relative_to(path) for d in documents if d.stat().st_size], val_share)
        if path.is_dir()
        else set()
    )
    return path, documents, validation


def _parts(path: Path, document: Path, text: bytes, validation, val_share) -> dict[str, bytes]:
    """Where a document's bytes go: its split, or for a single file, head and tail."""
    if path.is_file():  # one document: hold out its tail
        cut = len(text) - int(len(text) * val_share)
        return {"train": text[:cut], "val": text[cut:]}
    return {"val" if document.relative_to(path) in validation else "train": text}


def training_texts(path: str | os.PathLike, glob: str, val_share: float) -> Iterator[bytes]:
    """The bytes of each training document (of a single file, its head), in corpus order:
    what a tokenizer learns from, so that validation text stays unseen."""
    path, documents, validation = _corpus(path, glob, val_share)
    for document in documents:
        part = _parts(path, document, document.read_bytes(), validation, val_share).get("train")
        if part:
            yield part


def write_tokens(
    path: str | os.PathLike,
    glob: str,
    val_share: float,
    folder: str | os.PathLike,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
    progress: Callable[[int], object] | None = None,
) -> dict:
    """Write ``folder/train.bin`` and ``folder/val.bin`` from the corpus, encoded by
    ``tokenizer`` (default: bytes), telling ``progress`` each document's bytes once encoded,
    and where each document starts in them
    (``folder/train.starts.bin``, ``folder/val.starts.bin``); return the corpus's summary.

    The summary (also saved as ``folder/data.json``) counts documents, bytes and tokens per
    split and the empty files skipped, and names the tokenizer, its vocabulary and the token
    dtype. Raises ValueError for an empty corpus or an empty split.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    folder = Path(folder)
    path, documents, validation = _corpus(path, glob, val_share)
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"source": str(path), "glob": glob, "val_share": val_share, "empty_skipped": 0}
    summary |= {f"{split}_{what}": 0 for split in SPLITS for what in ("documents", "bytes")}
    summary |= {f"{split}_tokens": 0 for split in SPLITS}
    summary |= {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size}
    summary["end_token"] = tokenizer.end_token  # the id that ends each document, or None
    summary["dtype"] = token_dtype(tokenizer.vocab_size)
    temporary = {split: folder / f".{split}.bin.tmp" for split in SPLITS}
    try:
        summary = _write_splits(
            path, documents, validation, summary, temporary, tokenizer, progress
        )
    except BaseException:  # nothing half-written stays behind
        for file in temporary.values():
            file.unlink(missing_ok=True)
        raise
    for split in SPLITS:
        os.replace(temporary[split], folder / f"{split}.bin")
    (folder / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _write_splits(path, documents, validation, summary, temporary, tokenizer, progress) -> dict:
    """Write each split's tokens to its ``temporary`` file and its document offsets to their
    final place; the summary counted, or a ValueError for an empty corpus or split."""
    folder, val_share = next(iter(temporary.values())).parent, summary["val_share"]
    typecode = TYPECODES[DTYPES[summary["dtype"]].itemsize]
    outputs = {split: file.open("wb") for split, file in temporary.items()}
    starts = {split: array("q") for split in SPLITS}  # int64 offsets of documents
    try:
        for document in documents:
            text = document.read_bytes()
            if not text:
                summary["empty_skipped"] += 1
                continue
            parts = _parts(path, document, text, validation, val_share)
            last = [split for split, part in parts.items() if part][-1]  # the document's end
            for split, part in parts.items():
                if not part:  # a file too short to hold out a tail: no document there
                    continue
                # byte tokens are the bytes themselves: written as they are
                ids = part if tokenizer.name == "bytes" else array(typecode, tokenizer.encode(part))
                if tokenizer.end_token is not None and split == last:
                    ids.append(tokenizer.end_token)  # the document (not a file's head) ends
                starts[split].append(summary[f"{split}_tokens"])
                outputs[split].write(ids)
                summary[f"{split}_documents"] += 1
                summary[f"{split}_bytes"] += len(part)
                summary[f"{split}_tokens"] += len(ids)
            if progress is not None:
                progress(len(text))
    finally:
        for output in outputs.values():
            output.close()
    if summary["empty_skipped"] == len(documents):
        raise ValueError(f"data {str(path)!r}: every matched file is empty ({len(documents)})")
    for split in SPLITS:
        if summary[f"{split}_bytes"] == 0:
            raise ValueError(
                f"data {str(path)!r}: the {split} split is empty ({summary['train_documents']} "
                f"train and {summary['val_documents']} validation documents at val_share "
                f"{val_share}); add documents or change --val-share"
            )
    for split in SPLITS:
        (folder / STARTS.format(split=split)).write_bytes(starts[split].tobytes())
    return summary


def read_summary(folder: str | os.PathLike) -> dict | None:
    """The summary of tokens already written to ``folder``, or None if there is none. One
    written before BPE existed is of byte tokens, and gets their fields."""
    path = Path(folder) / SUMMARY
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(path)!r} is damaged ({error}); start the run again") from None
    counts = [f"{split}_{what}" for split in SPLITS for what in ("documents", "bytes")]
    if (
        not isinstance(summary, dict)
        or not all(isinstance(summary.get(name), int) and summary[name] >= 0 for name in counts)
        or not isinstance(summary.get("source"), str)
    ):
        raise ValueError(
            f"{str(path)!r} is damaged (expected source and {', '.join(counts)}); start the "
            "run again"
        )
    byte_fields = {"tokenizer": "bytes", "vocab_size": ByteTokenizer.vocab_size, "dtype": "uint8"}
    byte_fields |= {f"{split}_tokens": summary[f"{split}_bytes"] for split in SPLITS}
    summary = byte_fields | summary
    numbers = [summary[f"{split}_tokens"] for split in SPLITS] + [summary["vocab_size"]]
    if (
        summary["dtype"] not in DTYPES
        or not isinstance(summary["tokenizer"], str)
        or not all(isinstance(value, int) and value >= 0 for value in numbers)
    ):
        raise ValueError(
            f"{str(path)!r} is damaged (expected tokenizer, vocab_size, dtype among "
            f"{', '.join(DTYPES)} and token counts); start the run again"
        )
    return summary


def _checked_file(folder: Path, name: str, size: int | None) -> Path:
    """``folder / name``, which must exist and, when ``size`` is known, hold that many bytes."""
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{str(path)!r} is missing; start the run again")
    if size is not None and path.stat().st_size != size:
        raise ValueError(
            f"{str(path)!r} holds {path.stat().st_size} bytes where {SUMMARY} says {size}: "
            "it is damaged; start the run again"
        )
    return path


def load_tokens(folder: str | os.PathLike, split: str, length: int) -> Tensor:
    """The memory-mapped tokens ``(N,)`` of one split (of the dtype the folder's summary
    names; uint8 without one), checked against the summary and to hold a sequence."""
    summary = read_summary(folder) or {}
    dtype = DTYPES[summary.get("dtype", "uint8")]
    tokens = summary.get(f"{split}_tokens")
    width = dtype.itemsize
    path = _checked_file(Path(folder), f"{split}.bin", None if tokens is None else tokens * width)
    size = path.stat().st_size // width
    if size <= length:
        raise ValueError(
            f"the {split} split has {size} tokens, too few for one sequence of length {length} "
            "plus its next-token target; use more data or a smaller --length"
        )
    return torch.from_file(str(path), shared=False, size=size, dtype=dtype)


def load_starts(folder: str | os.PathLike, split: str) -> Tensor:
    """Where each document of one split starts ``(D,)`` int64, ascending from 0."""
    path = Path(folder) / STARTS.format(split=split)
    if not path.is_file():
        raise ValueError(
            f"{str(path)!r} is missing: these token files were written without document "
            "offsets, which packing needs; start a new run (or --overwrite this one)"
        )
    summary = read_summary(folder) or {}
    documents, size = summary.get(f"{split}_documents"), summary.get(f"{split}_tokens")
    _checked_file(Path(folder), path.name, None if documents is None else 8 * documents)
    if path.stat().st_size % 8:
        raise ValueError(f"{str(path)!r} is damaged (not whole int64 offsets); start again")
    starts = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.int64)  # (D,)
    inside = size is None or not len(starts) or int(starts[-1]) < size
    if len(starts) and (starts[0] != 0 or not bool((starts[1:] > starts[:-1]).all()) or not inside):
        raise ValueError(
            f"{str(path)!r} is damaged (offsets must rise from 0 inside the {split} tokens); "
            "start the run again"
        )
    return starts


class Batch(NamedTuple):
    """One batch of rows: what the model reads, what it should predict, and its documents."""

    inputs: Tensor  # (B, T) int64
    targets: Tensor  # (B, T) int64, IGNORED where no target counts
    document_ids: Tensor | None = None  # (B, T) int64 for packed rows


def windows(tokens: Tensor, starts: Tensor, length: int) -> Batch:
    """Inputs and next-token targets ``(B, length)`` int64 at ``starts (B,)``."""
    offsets = torch.arange(length + 1)  # (length + 1,)
    window = tokens[starts.view(-1, 1) + offsets].long()  # (B, length + 1)
    return Batch(window[:, :-1], window[:, 1:])


@dataclass
class Batches:
    """Random windows of one split, drawn by a seeded generator whose state is the data position.

    Every rank draws the same global batch; checkpoints save :meth:`state_dict`, so a resumed
    run continues with the very batches the uninterrupted run would have drawn.
    """

    tokens: Tensor  # (N,) unsigned ints
    length: int
    seed: int

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def next(self, batch: int) -> Batch:
        """The next global batch: inputs and targets ``(batch, length)`` int64."""
        starts = torch.randint(
            len(self.tokens) - self.length, (batch,), generator=self.generator
        )  # (batch,)
        return windows(self.tokens, starts, self.length)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


@dataclass
class PackedBatches(Batches):
    """Rows of whole documents, each kept to itself by ``document_ids``.

    A document of more than ``length + 1`` tokens is cut into pieces of ``length`` targets
    (``length + 1`` tokens; each piece's first token is the last of the one before, so no
    target is lost). A row starts at a piece drawn uniformly: a piece that fills the row is
    the row; a document's last piece is followed by the whole documents that fit. What
    remains of the row is padding (the start of the next document, kept to itself), and
    targets that cross into another document or into padding are ``IGNORED``.
    """

    starts: Tensor  # (D,) int64: where each document starts in tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ends = torch.cat([self.starts[1:], torch.tensor([len(self.tokens)])])  # (D,)
        targets = (self.ends - self.starts - 1).clamp(min=0)  # (D,)
        pieces = -(-targets // self.length)  # (D,) a one-token document has none
        self.first_piece = pieces.cumsum(0) - pieces  # (D,) index of each document's first
        self.pieces = int(pieces.sum())
        if self.pieces == 0:
            raise ValueError(
                f"packing needs a document of at least 2 tokens; these {len(self.starts)} "
                "documents have 1 each"
            )

    def next(self, batch: int) -> Batch:
        """The next global batch: inputs, targets and document ids ``(batch, length)``."""
        piece = torch.randint(self.pieces, (batch,), generator=self.generator)  # (B,)
        document = torch.searchsorted(self.first_piece, piece, right=True) - 1  # (B,)
        start = self.starts[document] + (piece - self.first_piece[document]) * self.length
        limit = start + self.length + 1  # (B,) one past the row's last token
        fitting = torch.searchsorted(self.ends, limit, right=True).sub(1).clamp(min=0)  # (B,)
        fitting = self.ends[fitting]  # (B,) the last document end within the row
        end = torch.where(self.ends[document] >= limit, limit, fitting)  # (B,) whole documents
        position = start.view(-1, 1) + torch.arange(self.length + 1)  # (B, length + 1)
        window = self.tokens[position.clamp(max=len(self.tokens) - 1)].long()
        ids = torch.searchsorted(self.ends, position, right=True)  # (B, length + 1)
        kept = (ids[:, 1:] == ids[:, :-1]) & (position[:, 1:] < end.view(-1, 1))  # (B, length)
        targets = window[:, 1:].masked_fill(~kept, IGNORED)
        return Batch(window[:, :-1], targets, ids[:, :-1])


def evaluation_batches(tokens: Tensor, length: int, batch: int, count: int) -> list[Batch]:
    """``count`` fixed batches whose windows are spread evenly over the whole split."""
    last = len(tokens) - length - 1
    starts = torch.linspace(0, last, count * batch).round().long()  # (count * batch,)
    return [windows(tokens, chunk, length) for chunk in starts.split(batch)]
