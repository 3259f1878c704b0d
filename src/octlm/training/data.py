"""Training data: a corpus -> one token file per split, memory-mapped.

A corpus is one file or a folder of files matched by a recursive glob, in any format
:mod:`octlm.training.corpus` reads (text, JSON Lines, JSON, Parquet, Arrow; plain or
compressed); its readers give documents, and one pipeline here splits, tokenises and writes
them, whatever their format, streaming: no file, long text or token list is held whole.

The split is the same on every machine and in every run, whatever order files are found in:

- a file that is one document (a text file, with no ``--separator``) goes to validation when a
  hash of its path (relative to the corpus root) falls below the validation share;
- a record of a file of many (a JSON line, a Parquet row, a part of a separated text file) goes
  there when a hash of (its file's relative path, its index in the file) does;
- a corpus that is one document (one text file, no separator) holds out its last
  ``val_share`` of bytes instead, as nanoGPT's shakespeare split does.

``data.json`` names the rule a corpus was split by (``split``).

Tokens are the bytes themselves (vocabulary 256), or the ids of the run's BPE
(:mod:`octlm.tokenizer`), which encodes each document on its own, so documents start on token
boundaries, and ends each with its end-of-text token (the head of a single file held out at its
tail is no end, and gets none); a window of the token stream that straddles two documents sees
where one ends, and a packed row predicts its documents' ends. They are written as they are made
to ``train.bin`` and ``val.bin`` as unsigned ints of the smallest width that holds the vocabulary
(uint8 for bytes, uint16 up to 65,536 tokens; the dtype is in ``data.json``) and read back
with ``torch.from_file``, a memory map: a corpus larger than memory costs only the pages that
batches touch. Beside each, ``train.starts.bin``
and ``val.starts.bin`` hold where each document starts (int64 offsets, in tokens), for packed
batches. Each file is written under a temporary name and renamed once all are whole, so an
error or a signal leaves no half-written file and an earlier folder's files as they were.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from octlm.tokenizer import MAX_VOCAB, BPETokenizer, ByteTokenizer, text_pieces
from octlm.training import corpus
from octlm.training.corpus import DEFAULT_GLOB, DEFAULT_TOKENIZER_SAMPLE, SKIPPED_FOLDERS, Formats

__all__ = ["DEFAULT_GLOB", "DEFAULT_TOKENIZER_SAMPLE", "SKIPPED_FOLDERS", "Formats"]

SPLITS = ("train", "val")
STDLIB_GLOB = "**/*.py"
SUMMARY = "data.json"
STARTS = "{split}.starts.bin"
TOKEN_FILES = tuple(
    name.format(split=split) for split in SPLITS for name in ("{split}.bin", STARTS)
)
# Every file write_tokens may leave in its folder: a folder of nothing else is octlm's own.
OWN_FILES = frozenset(
    {SUMMARY, *TOKEN_FILES} | {f".{name}.tmp" for name in (*TOKEN_FILES, SUMMARY)}
)
IGNORED = -100  # a target that counts for nothing (F.cross_entropy's default ignore_index)
# Token file dtypes, narrowest first, and the array typecode of each width.
DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32}
TYPECODES = {1: "B", 2: "H", 4: next(code for code in "IL" if array(code).itemsize == 4)}
BATCH_BYTES = 1 << 20  # short documents are encoded together, this many bytes at a time
# How the split was made (data.json's "split"), by what the corpus holds.
RULES = {
    "tail": "its one document's last share of bytes",
    "file": "a hash of each file's path",
    "record": "a hash of each record's file and index",
    "file and record": "a hash of each one-document file's path, and of each record's file "
    "and index",
}


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
    return corpus.find_files(path, glob)


def path_fraction(relative: Path) -> float:
    """A document's place in [0, 1): the hash of its path relative to the corpus root."""
    # fsencode: a name that is not UTF-8 hashes as its own bytes, a UTF-8 one as its encoding
    return _fraction(os.fsencode(relative.as_posix()))


def record_fraction(relative: Path, index: int) -> float:
    """A record's place in [0, 1): the hash of its file's relative path and its index there."""
    return _fraction(os.fsencode(relative.as_posix()) + b"\0" + str(index).encode())


def _fraction(key: bytes) -> float:
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64


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


@dataclass(frozen=True)
class Corpus:
    """A corpus's files and how its documents are read and split."""

    root: Path
    files: list[Path]
    val_share: float
    formats: Formats
    validation: frozenset[Path]  # the one-document files held out (relative to root)

    @classmethod
    def open(
        cls, path: str | os.PathLike, glob: str, val_share: float, formats: Formats | None = None
    ) -> Corpus:
        """The corpus at ``path``; ValueError when it does not exist or holds no file."""
        root, formats = Path(path), formats or Formats()
        files = find_documents(root, glob)
        whole = [f for f in files if corpus.is_whole(f, formats)]
        sized = [f.relative_to(root) for f in whole if f.stat().st_size] if root.is_dir() else []
        return cls(root, files, val_share, formats, frozenset(held_out(sized, val_share)))

    @property
    def rule(self) -> str:
        """How the corpus is split: a key of :data:`RULES`."""
        if self.root.is_file() and corpus.is_whole(self.root, self.formats):
            return "tail"
        kinds = {"file" if corpus.is_whole(f, self.formats) else "record" for f in self.files}
        return "file and record" if len(kinds) == 2 else kinds.pop()

    def relative(self, file: Path) -> Path:
        """A file's path relative to the corpus root (its name, for a corpus of one file)."""
        return Path(file.name) if self.root.is_file() else file.relative_to(self.root)

    def check_files(self) -> None:
        """Raise ValueError where the files alone show the corpus cannot be split: every
        one-document file empty, or none of them left for training."""
        if self.rule == "tail" and not self.files[0].stat().st_size:
            raise ValueError(f"data {str(self.root)!r} is empty")
        if self.rule != "file":
            return
        sizes = {self.relative(f): f.stat().st_size for f in self.files}
        if not any(sizes.values()):
            raise ValueError(f"data {str(self.root)!r}: every matched file is empty ({len(sizes)})")
        if not any(size for name, size in sizes.items() if name not in self.validation):
            raise ValueError(
                f"data {str(self.root)!r}: the training split is empty (its only non-empty file "
                f"is held out for validation at --val-share {self.val_share}); add files"
            )

    def parts(self) -> Iterator[Part]:
        """Every document's text and its split, in corpus order (a corpus of one document:
        its head for training, its tail, which ends it, for validation)."""
        if self.rule == "tail":
            yield from self._head_and_tail(self.files[0])
            return
        for file in self.files:
            relative = self.relative(file)
            for document in corpus.read(file, relative, self.formats):
                if document.index is None:
                    held = relative in self.validation
                else:
                    held = record_fraction(relative, document.index) < self.val_share
                key = os.fsencode(relative.as_posix()) + f"\0{document.index}".encode()
                yield Part("val" if held else "train", document.text, True, key)

    def _head_and_tail(self, file: Path) -> Iterator[Part]:
        length = corpus.text_length(file)
        cut = length - int(length * self.val_share)
        documents = corpus.read(file, self.relative(file), self.formats)  # open while read
        head, tail = _cut(next(documents).text, cut)
        key = os.fsencode(self.relative(file).as_posix())
        yield Part("train", head, False, key)
        yield Part("val", tail, True, key)


def _cut(text: Iterable[bytes], at: int) -> tuple[Iterator[bytes], Iterator[bytes]]:
    """The pieces of a text before byte ``at``, and after it (read once the first are)."""
    blocks, rest = iter(text), []

    def head() -> Iterator[bytes]:
        seen = 0
        for block in blocks:
            if seen + len(block) >= at:
                yield block[: at - seen]
                rest.append(block[at - seen :])
                return
            seen += len(block)
            yield block

    return head(), (piece for part in (rest, blocks) for piece in part)


class Part(NamedTuple):
    """A document's text (or its head or tail) and where it goes."""

    split: str
    text: Iterable[bytes]
    ends: bool  # whether the document ends here (and gets the end-of-text token)
    key: bytes  # its file's relative path and index there: what samples hash


def training_texts(
    path: str | os.PathLike,
    glob: str,
    val_share: float,
    *,
    formats: Formats | None = None,
    sample: int | None = DEFAULT_TOKENIZER_SAMPLE,
) -> Iterator[bytes]:
    """The texts a tokenizer learns from: the training documents (of a single file, its head),
    in corpus order and in pieces of at most about a megabyte, so that validation text stays
    unseen. Above ``sample`` bytes of corpus (None: no limit), a share of the pieces chosen by
    the hash of their place, up to ``sample`` bytes.

    The corpus is checked here, before any text is read: ValueError for a path that does not
    exist, a folder without matching files, or files that leave no training text.
    """
    found = Corpus.open(path, glob, val_share, formats)
    found.check_files()
    return _training_texts(found, sample)


def _training_texts(found: Corpus, sample: int | None) -> Iterator[bytes]:
    share = 1.0 if sample is None else min(1.0, sample / max(estimated_bytes(found), 1))
    given = 0
    for part in found.parts():
        if part.split != "train":
            continue
        for index, text in enumerate(text_pieces(part.text)):
            if share < 1 and _fraction(part.key + f"#{index}".encode()) >= share:
                continue
            data = text.encode("utf-8", errors="surrogateescape")
            yield data
            given += len(data)
            if sample is not None and given >= sample:
                return


def estimated_bytes(found: Corpus) -> int:
    """About how many bytes the corpus's texts hold: a compressed file's (or Parquet's) size
    times 4."""
    squeezed = [corpus.compression_of(f) or corpus.format_of(f) == "parquet" for f in found.files]
    return sum(
        f.stat().st_size * (4 if s else 1) for f, s in zip(found.files, squeezed, strict=True)
    )


def write_tokens(
    path: str | os.PathLike,
    glob: str,
    val_share: float,
    folder: str | os.PathLike,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
    progress: Callable[[int], object] | None = None,
    *,
    formats: Formats | None = None,
) -> dict:
    """Write ``folder/train.bin`` and ``folder/val.bin`` from the corpus, encoded by
    ``tokenizer`` (default: bytes), telling ``progress`` each document's bytes once read,
    and where each document starts in them
    (``folder/train.starts.bin``, ``folder/val.starts.bin``); return the corpus's summary.

    The summary (also saved as ``folder/data.json``) counts documents, bytes and tokens per
    split and the empty documents skipped, names the tokenizer, its vocabulary and the token
    dtype, the split's rule, the formats' options and the corpus's files (names, sizes and
    modification times: its fingerprint). Raises ValueError for an empty corpus or an empty
    split, or a file that cannot be read as its format, naming it.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    folder = Path(folder)
    found = Corpus.open(path, glob, val_share, formats)
    found.check_files()
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"source": str(found.root), "glob": glob, "val_share": val_share}
    summary |= {"split": found.rule, "formats": options_of(found), "empty_skipped": 0}
    summary |= {f"{split}_{what}": 0 for split in SPLITS for what in ("documents", "bytes")}
    summary |= {f"{split}_tokens": 0 for split in SPLITS}
    summary |= {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size}
    summary["end_token"] = tokenizer.end_token  # the id that ends each document, or None
    summary["dtype"] = token_dtype(tokenizer.vocab_size)
    summary["files"] = fingerprint(found)
    typecode = TYPECODES[DTYPES[summary["dtype"]].itemsize]
    writers = {split: _SplitWriter(folder, split, typecode, summary) for split in SPLITS}
    try:
        try:
            _write_splits(found, tokenizer, writers, summary, progress or (lambda size: None))
        finally:
            for writer in writers.values():
                writer.close()
        _check_splits(found, summary)
        (folder / SUMMARY).unlink(missing_ok=True)  # an earlier folder's: its files go now
        for name in TOKEN_FILES:
            os.replace(folder / f".{name}.tmp", folder / name)
        write_summary(folder, summary)
    except BaseException:  # nothing half-written stays behind
        for name in TOKEN_FILES:
            (folder / f".{name}.tmp").unlink(missing_ok=True)
        raise
    return summary


def options_of(found: Corpus) -> dict:
    """The format options that shaped the corpus's documents."""
    return {"text_field": found.formats.text_field, "separator": found.formats.separator}


def fingerprint(found: Corpus) -> list[list]:
    """Each file of a corpus as [relative path, size, modification time in ns]: what tells a
    corpus changed since its tokens were written."""
    return [
        [found.relative(f).as_posix(), f.stat().st_size, f.stat().st_mtime_ns] for f in found.files
    ]


def write_summary(folder: Path, summary: dict) -> None:
    """Write ``folder/data.json`` under a temporary name, then rename it into place."""
    temporary = folder / f".{SUMMARY}.tmp"
    temporary.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(temporary, folder / SUMMARY)


class _SplitWriter:
    """One split's token and offset files, written as documents come, under temporary names."""

    def __init__(self, folder: Path, split: str, typecode: str, summary: dict):
        self.split, self.typecode, self.summary = split, typecode, summary
        self.tokens = (folder / f".{split}.bin.tmp").open("wb")
        self.starts = (folder / f".{STARTS.format(split=split)}.tmp").open("wb")

    def write(self, pieces: Iterable, size: int, end_token: int | None) -> None:
        """One document (or its head or tail) of ``size`` bytes, from its tokens in
        ``pieces``, then ``end_token`` (None: no end)."""
        count = f"{self.split}_tokens"
        self.starts.write(array("q", [self.summary[count]]))
        for ids in pieces:
            self.tokens.write(ids if isinstance(ids, bytes) else array(self.typecode, ids))
            self.summary[count] += len(ids)
        if end_token is not None:
            self.tokens.write(array(self.typecode, [end_token]))
            self.summary[count] += 1
        self.summary[f"{self.split}_documents"] += 1
        self.summary[f"{self.split}_bytes"] += size

    def close(self) -> None:
        self.tokens.close()
        self.starts.close()


def _write_splits(found: Corpus, tokenizer, writers: dict, summary: dict, progress) -> None:
    """Encode every document into its split's writer: short ones together, in batches of
    about :data:`BATCH_BYTES`, long ones a piece at a time; in corpus order."""
    pending: list[tuple[Part, bytes]] = []  # short documents waiting to be encoded

    def end_of(part: Part) -> int | None:
        return tokenizer.end_token if part.ends else None

    def flush() -> None:
        encoded = tokenizer.encode_batch([text for _, text in pending])
        for (part, text), ids in zip(pending, encoded, strict=True):
            writers[part.split].write([ids], len(text), end_of(part))
        progress(sum(len(text) for _, text in pending))
        pending.clear()

    def counted(chunks: Iterator[bytes], size: list[int]) -> Iterator[bytes]:
        for chunk in chunks:
            size[0] += len(chunk)
            progress(len(chunk))
            yield chunk

    for part in found.parts():
        pieces = iter(part.text)
        first, second = next(pieces, b""), next(pieces, None)
        if second is None and len(first) <= BATCH_BYTES:  # a short document
            if not first:
                summary["empty_skipped"] += found.rule != "tail"
                continue
            pending.append((part, first))
            if sum(len(text) for _, text in pending) >= BATCH_BYTES:
                flush()
            continue
        flush()
        size = [0]
        chunks = counted(_chain(first, second, pieces), size)
        tokens = tokenizer.encode_stream(chunks)
        writers[part.split].write(tokens, 0, end_of(part))  # its size, once read:
        summary[f"{part.split}_bytes"] += size[0]
    flush()


def _chain(first: bytes, second: bytes | None, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    if second is not None:
        yield second
        yield from rest


def _check_splits(found: Corpus, summary: dict) -> None:
    """Raise ValueError for a corpus of no text, or a split without any."""
    if not summary["train_bytes"] + summary["val_bytes"]:
        what = {"tail": "its text", "file": "every matched file"}.get(
            found.rule, f"field {found.formats.text_field!r} of every record"
        )
        skipped = summary["empty_skipped"]
        raise ValueError(
            f"data {str(found.root)!r}: {what} is empty" + f" ({skipped})" * bool(skipped)
        )
    for split in SPLITS:
        if summary[f"{split}_bytes"] == 0:
            raise ValueError(
                f"data {str(found.root)!r}: the {split} split is empty "
                f"({summary['train_documents']} train and {summary['val_documents']} validation "
                f"documents at val_share {found.val_share}); add documents or change --val-share"
            )


def held_out_share(summary: dict) -> float:
    """The share of the corpus's bytes that went to validation."""
    total = summary["train_bytes"] + summary["val_bytes"]
    return summary["val_bytes"] / total if total else 0.0


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
    # float64: float32 rounds starts past 2**24 tokens, the last one beyond the split's end
    starts = torch.linspace(0, last, count * batch, dtype=torch.float64).round().long()  # (n,)
    return [windows(tokens, chunk, length) for chunk in starts.split(batch)]
