"""A corpus opened once: its files, their sizes, its split and the documents it yields.

A corpus is one file or a folder of files matched by a recursive glob, in any format
:mod:`octlm.training.readers` reads (text, JSON Lines, JSON, Parquet, Arrow; plain or
compressed). :meth:`Corpus.open` finds and stats its files once; every stage of a command
(the recipe's size estimate, the BPE's training text, the token writer, the change check)
is handed that one object.

The split is the same on every machine and in every run, whatever order files are found in:

- a file that is one document (a text file, with no ``--separator``) goes to validation when a
  hash of its path (relative to the corpus root) falls below the validation share;
- a record of a file of many (a JSON line, a Parquet row, a part of a separated text file) goes
  there when a hash of (its file's relative path, its index in the file) does;
- a corpus that is one document (one text file, no separator) holds out its last
  ``val_share`` of bytes instead, as nanoGPT's shakespeare split does.

``data.json`` names the rule a corpus was split by (``split``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from octlm.chatml import Message
from octlm.tokenizer import text_pieces
from octlm.training import readers
from octlm.training.formats import DEFAULT_GLOB, DEFAULT_TOKENIZER_SAMPLE, Formats

STDLIB_GLOB = "**/*.py"
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


class Part(NamedTuple):
    """A document's text (or its head or tail), or its conversation or a bad record's
    problem (:class:`readers.Document`), and where it goes."""

    split: str
    text: Iterable[bytes]
    ends: bool  # whether the document ends here (and gets the end-of-text token)
    key: bytes  # its file's relative path and index there: what samples hash
    messages: list[Message] | None = None  # a conversation's (its text is empty)
    problem: str | None = None  # a bad record's, naming its file and line or row


@dataclass(frozen=True)
class Corpus:
    """A corpus's files (with their size and modification time, read once), how its documents
    are read and how they split."""

    root: Path
    glob: str
    files: tuple[Path, ...]
    stats: tuple[tuple[int, int], ...]  # each file's (size in bytes, modification time in ns)
    val_share: float
    formats: Formats
    rule: str  # a key of RULES
    validation: frozenset[Path]  # the one-document files held out (relative to root)

    @classmethod
    def open(
        cls, path: str | os.PathLike, glob: str, val_share: float, formats: Formats | None = None
    ) -> Corpus:
        """The corpus at ``path``; ValueError when it does not exist or holds no file."""
        root, formats = Path(path), formats or Formats()
        files = tuple(readers.find_files(root, glob))
        stats = tuple((s.st_size, s.st_mtime_ns) for s in map(os.stat, files))
        whole = [readers.is_whole(f, formats) for f in files]
        if root.is_file() and whole[0]:
            rule = "tail"
        else:
            rule = {(True,): "file", (False,): "record"}.get(tuple(set(whole)), "file and record")
        sized = [
            f.relative_to(root)
            for f, (size, _), one in zip(files, stats, whole, strict=True)
            if one and size
        ]
        validation = frozenset(held_out(sized, val_share)) if root.is_dir() else frozenset()
        return cls(root, glob, files, stats, val_share, formats, rule, validation)

    @classmethod
    def of(cls, run) -> Corpus:
        """The corpus a run names: ``run.data`` (every format by default), or this Python's
        standard library, with the run's glob, validation share and format options (its chat
        format and strictness among them)."""
        if run.data is None:
            root, glob = default_corpus()
        else:
            root, glob = Path(run.data), DEFAULT_GLOB
        chat_format = run.chat_format if run.chat else None  # --chat: conversations
        formats = Formats(run.text_field, run.separator, chat_format, run.strict)
        return cls.open(root, run.glob or glob, run.val_share, formats)

    def relative(self, file: Path) -> Path:
        """A file's path relative to the corpus root (its name, for a corpus of one file)."""
        return Path(file.name) if self.root.is_file() else file.relative_to(self.root)

    @cached_property
    def estimated_bytes(self) -> int:
        """About how many bytes the corpus's texts hold (:func:`readers.estimated_text`)."""
        return sum(
            readers.estimated_text(f, size)
            for f, (size, _) in zip(self.files, self.stats, strict=True)
        )

    @property
    def fingerprint(self) -> list[list]:
        """Each file as [relative path, size, modification time in ns]: what tells a corpus
        changed since its tokens were written."""
        return [
            [self.relative(f).as_posix(), size, mtime]
            for f, (size, mtime) in zip(self.files, self.stats, strict=True)
        ]

    @property
    def options(self) -> dict:
        """The format options that shaped the corpus's documents (a corpus of plain text: the
        two that token folders have always recorded, so theirs stay up to date)."""
        options = {"text_field": self.formats.text_field, "separator": self.formats.separator}
        if self.formats.chat_format is not None:
            options |= {"chat_format": self.formats.chat_format, "strict": self.formats.strict}
        return options

    def check_files(self) -> None:
        """Raise ValueError where the files alone show the corpus cannot be split: every
        one-document file empty, or none of them left for training."""
        if self.rule == "tail" and not self.stats[0][0]:
            raise ValueError(f"data {str(self.root)!r} is empty")
        if self.rule != "file":
            return
        sizes = {
            self.relative(f): size for f, (size, _) in zip(self.files, self.stats, strict=True)
        }
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
            for document in readers.read(file, relative, self.formats):
                if document.index is None:
                    held = relative in self.validation
                else:
                    held = record_fraction(relative, document.index) < self.val_share
                key = os.fsencode(relative.as_posix()) + f"\0{document.index}".encode()
                split = "val" if held else "train"
                yield Part(split, document.text, True, key, document.messages, document.problem)

    def _head_and_tail(self, file: Path) -> Iterator[Part]:
        length = readers.text_length(file)
        cut = length - int(length * self.val_share)
        documents = readers.read(file, self.relative(file), self.formats)  # open while read
        head, tail = _cut(next(documents).text, cut)
        key = os.fsencode(self.relative(file).as_posix())
        yield Part("train", head, False, key)
        yield Part("val", tail, True, key)

    def training_texts(self, sample: int | None = DEFAULT_TOKENIZER_SAMPLE) -> Iterator[bytes]:
        """The texts a tokenizer learns from: the training documents (of a single file, its
        head), in corpus order and in pieces of at most about a megabyte, so that validation
        text stays unseen. Above ``sample`` bytes of corpus (None: no limit), a share of the
        pieces chosen by the hash of their place, up to ``sample`` bytes.

        The files are checked first (:meth:`check_files`), before any text is read.
        """
        self.check_files()
        return self._training_texts(sample)

    def _training_texts(self, sample: int | None) -> Iterator[bytes]:
        share = 1.0 if sample is None else min(1.0, sample / max(self.estimated_bytes, 1))
        given = 0
        for part in self.parts():
            if part.split != "train" or part.problem is not None:
                continue
            for index, text in enumerate(text_pieces(_text_of(part))):
                if share < 1 and _fraction(part.key + f"#{index}".encode()) >= share:
                    continue
                data = text.encode("utf-8", errors="surrogateescape")
                yield data
                given += len(data)
                if sample is not None and given >= sample:
                    return


def _text_of(part: Part) -> Iterable[bytes]:
    """A part's text; a conversation's: its messages' contents, a line apart."""
    if part.messages is None:
        return part.text
    return (
        "\n".join(message.content for message in part.messages).encode("utf-8", "surrogatepass"),
    )


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
