"""Corpus files -> documents: one small reader per format, chosen by the file's name.

A reader yields :class:`Document` s: a document's text as bytes in pieces (read as they are
consumed, so no file, and no long text, is ever held whole), the file it came from (relative to
the corpus root) and its index in that file (None where the file is one document). What
happens to the documents (the split, the tokenizer, the token files) is
:mod:`octlm.training.data`'s, one pipeline for every format.

Formats, by the name's last suffix after any compression suffix (``.gz``, ``.zst``, ``.xz``,
``.bz2``, decompressed as the file is read):

- text (``.txt``, ``.md`` and any other name): one document, or with a separator one per part;
- JSON Lines (``.jsonl``, ``.ndjson``, and a ``.json`` file that does not begin with ``[``):
  one record per line, its document in a field (a dotted path reaches into nested records);
- a JSON array of records (a ``.json`` file beginning with ``[``), read whole, so only up to
  :data:`JSON_ARRAY_LIMIT` bytes;
- Parquet (``.parquet``): a column, read a batch of rows at a time (``pyarrow``);
- Arrow (``.arrow``): the IPC stream files ``datasets.save_to_disk`` writes, or IPC files.

A record whose field is empty or null is a document of no text: the pipeline skips and counts
it. Anything else that is not a text is a ValueError naming the file, the line or row, and
the field.
"""

from __future__ import annotations

import bz2
import fnmatch
import gzip
import io
import itertools
import json
import lzma
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

BLOCK = 1 << 20  # bytes read at a time from a text file
JSON_ARRAY_LIMIT = 128 * 2**20  # a JSON array is parsed whole: beyond this, JSON Lines
DEFAULT_TOKENIZER_SAMPLE = 200 * 10**6  # bytes of training text a BPE learns from at most
ROWS = 1024  # rows of a Parquet file decoded at a time
EXTRA = "pip install 'octlm[data]'"  # pyarrow, and zstandard where Python has no zstd
COMPRESSIONS = (".gz", ".zst", ".xz", ".bz2")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS |= {".arrow": "arrow"}
# Every format above, plain or compressed (``--glob``'s default for a --data folder).
DEFAULT_GLOB = "**/*.{txt,md,jsonl,ndjson,json,parquet,arrow}{,.gz,.zst,.xz,.bz2}"
# What datasets.save_to_disk writes beside its .arrow files: descriptions, not documents.
DATASET_FILES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
# Installed packages are not the standard library, wherever an interpreter keeps them.
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BRACES = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class Formats:
    """How documents are found in files: the field of a record that holds its text, and the
    separator that cuts a text file into documents (None: each text file is one)."""

    text_field: str = "text"
    separator: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text_field, str) or not all(self.text_field.split(".")):
            raise ValueError(
                f"text_field must name a field (a.b for a nested one), got {self.text_field!r}"
            )
        if self.separator is not None and (
            not isinstance(self.separator, str) or not self.separator
        ):
            raise ValueError(f"separator must be a non-empty string, got {self.separator!r}")


class Document(NamedTuple):
    """One document of a corpus.

    ``text`` yields its bytes in pieces and must be read through before the next document is
    asked for (the pieces of a long one come from the file as they are read).
    """

    text: Iterable[bytes]
    source: Path  # its file, relative to the corpus root
    index: int | None  # its record (or part) in that file; None: the file is one document


def expand_braces(glob: str) -> list[str]:
    """``glob`` with each ``{a,b}`` spelled out: ``*.{txt,md}`` -> ``*.txt``, ``*.md``."""
    parts = BRACES.split(glob)  # text, choices, text, choices, ..., text
    choices = [part.split(",") if index % 2 else [part] for index, part in enumerate(parts)]
    return list(dict.fromkeys("".join(chosen) for chosen in itertools.product(*choices)))


def find_files(path: str | os.PathLike, glob: str) -> list[Path]:
    """The files of a corpus, sorted: ``path`` itself, or the files under it matching ``glob``
    (``{a,b}`` alternatives allowed), without installed packages' folders and, beside
    ``.arrow`` files, the descriptions ``datasets`` writes there."""
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"data {str(path)!r} does not exist: expected a corpus file or a folder of them"
        )
    if path.is_file():
        return [path]
    found = {
        file
        for file in _globbed(path, expand_braces(glob))
        if file.is_file() and not SKIPPED_FOLDERS.intersection(file.relative_to(path).parts)
    }
    arrow_folders = {file.parent for file in found if format_of(file) == "arrow"}
    files = sorted(f for f in found if not (f.name in DATASET_FILES and f.parent in arrow_folders))
    if not files:
        raise ValueError(f"data folder {str(path)!r} has no file matching glob {glob!r}")
    return files


def _globbed(path: Path, patterns: list[str]) -> Iterator[Path]:
    """The paths under ``path`` matching any of ``patterns``: one walk of the folders where
    the patterns differ only in the name they match (``**/*.txt``, ``**/*.md``)."""
    folders = {pattern.rpartition("/")[0] for pattern in patterns}
    if len(folders) > 1:
        yield from (found for pattern in patterns for found in path.glob(pattern))
        return
    folder = folders.pop()
    names = [pattern.rpartition("/")[2] for pattern in patterns]
    for found in path.glob(f"{folder}/*" if folder else "*"):
        if any(fnmatch.fnmatchcase(found.name, name) for name in names):
            yield found


def compression_of(path: Path) -> str | None:
    """The compression suffix of a file's name (``.gz``...), or None."""
    return path.suffix if path.suffix in COMPRESSIONS else None


def format_of(path: Path) -> str:
    """The format a file is read as: text, jsonl, json, parquet or arrow."""
    name = path.with_suffix("") if compression_of(path) else path
    return FORMATS.get(name.suffix.lower(), "text")


def is_whole(path: Path, formats: Formats) -> bool:
    """Whether a file is one document: a text file, when no separator cuts it."""
    return format_of(path) == "text" and formats.separator is None


def read(path: Path, relative: Path, formats: Formats) -> Iterator[Document]:
    """The documents of one corpus file, by its format."""
    reader = {"text": _text, "jsonl": _json_lines, "json": _json}
    reader |= {"parquet": _parquet, "arrow": _arrow}
    with _Stream(path, relative) as stream:
        yield from reader[format_of(path)](stream, relative, formats)


def text_length(path: Path) -> int:
    """The bytes of a file once decompressed (read through for a compressed one)."""
    if compression_of(path) is None:
        return path.stat().st_size
    with _Stream(path, path) as stream:
        return sum(len(block) for block in stream.blocks())


class _Stream:
    """A corpus file's bytes, decompressed by its name's suffix; an error of its reading or
    decompressing is a ValueError naming the file."""

    def __init__(self, path: Path, relative: Path):
        self.path, self.relative = path, relative
        opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open, ".zst": _zstd_open}
        self.file = self._reading(lambda: opener.get(compression_of(path), open)(path, "rb"))
        self.spooled = None  # a compressed file's bytes, where a reader must seek

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *error) -> None:
        self.file.close()
        if self.spooled is not None:
            self.spooled.close()

    def _reading(self, call: Callable):
        try:
            return call()
        except (OSError, EOFError, lzma.LZMAError) as error:
            raise ValueError(f"{self._name()}: cannot be read ({error})") from None
        except Exception as error:  # zstandard's ZstdError
            if type(error).__name__ != "ZstdError":
                raise
            raise ValueError(f"{self._name()}: cannot be read ({error})") from None

    def _name(self) -> str:
        compression = compression_of(self.path)
        return str(self.relative) + (f" ({compression[1:]}-compressed)" if compression else "")

    def read(self, size: int = -1) -> bytes:
        return self._reading(lambda: self.file.read(size))

    def blocks(self) -> Iterator[bytes]:
        """The file's bytes, :data:`BLOCK` at a time."""
        while block := self.read(BLOCK):
            yield block

    def lines(self) -> Iterator[bytes]:
        while line := self._reading(self.file.readline):
            yield line

    def seekable_file(self):
        """The file itself where it can seek; a compressed one decompressed to a temporary
        file first (Parquet reads its footer first)."""
        if compression_of(self.path) is None:
            return self.file
        self.spooled = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the stream)
        self._reading(lambda: shutil.copyfileobj(self.file, self.spooled, BLOCK))
        self.spooled.seek(0)
        return self.spooled


def _zstd_open(path: Path, mode: str):
    try:
        from compression import zstd  # Python 3.14 and later

        return zstd.open(path, mode)
    except ImportError:
        try:
            import zstandard
        except ImportError:
            raise ValueError(
                f"{str(path)!r}: reading .zst files needs zstandard: {EXTRA}"
            ) from None
    return io.BufferedReader(zstandard.open(path, mode))  # which reads lines


def _text(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    if formats.separator is None:
        yield Document(stream.blocks(), relative, None)
    else:
        yield from _separated(stream.blocks(), formats.separator.encode(), relative)


def _separated(blocks: Iterator[bytes], separator: bytes, relative: Path) -> Iterator[Document]:
    """The parts of a text between separators, each a document. The line break on either side
    of a separator goes with it, so a separator alone on its line leaves no blank edges."""
    held = b""  # read, not yet given out; it may end in the start of a separator
    keep = len(separator) + 2  # with the "\r\n" that may come before one
    done = False

    def part(first: bool) -> Iterator[bytes]:
        nonlocal held, done
        while not done:
            if first:  # the line break after the separator before goes with it
                while len(held) < 2 and (block := next(blocks, b"")):
                    held += block
                held = held[2:] if held.startswith(b"\r\n") else held.removeprefix(b"\n")
                first = False
            found = held.find(separator)
            if found >= 0:
                text, held = held[:found], held[found + len(separator) :]
                text = text[:-2] if text.endswith(b"\r\n") else text.removesuffix(b"\n")
                if text:
                    yield text
                return
            if len(held) > keep:
                yield held[:-keep]
                held = held[-keep:]
            block = next(blocks, None)
            if block is None:
                done = True
                if held:
                    yield held
            else:
                held += block

    for index in itertools.count():
        if not held and not done:  # a separator that ends the file starts no document
            held = next(blocks, b"")
            done = not held
        if done and (index or not held):
            return
        text = part(first=index > 0)
        yield Document(text, relative, index)
        for _ in text:  # what the reader of the document left unread
            pass


def _field(record: object, formats: Formats, where: str) -> bytes:
    """The text a record's field holds (empty for null), as UTF-8; ValueError naming the
    record (``where``) and the field when it has none or it is not a string."""
    value = record
    for key in formats.text_field.split("."):
        if not isinstance(value, dict) or key not in value:
            keys = ", ".join(map(repr, value)) if isinstance(value, dict) else type(value).__name__
            raise ValueError(
                f"{where}: no field {formats.text_field!r} (it has {keys or 'none'}); name the "
                "field that holds the text with --text-field"
            )
        value = value[key]
    if value is None:
        return b""
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {formats.text_field!r} holds {type(value).__name__} "
            f"{str(value)[:40]!r}, not a string"
        )
    return value.encode("utf-8", "surrogatepass")  # a lone surrogate becomes its own bytes


def _json_lines(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    return _records(stream.lines(), relative, formats)


def _records(lines: Iterable[bytes], relative: Path, formats: Formats) -> Iterator[Document]:
    """The documents of JSON Lines, one per line that is not blank."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(
                f"{relative}: line {number} is not JSON ({getattr(error, 'msg', error)}); JSON "
                "Lines hold one record per line"
            ) from None
        yield Document(
            (_field(record, formats, f"{relative}: line {number}"),), relative, number - 1
        )


def _json(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    """JSON Lines, or an array of records (read whole, up to :data:`JSON_ARRAY_LIMIT`)."""
    first, blank = stream.lines(), []
    head = next(first, b"")
    while head and not head.strip():  # kept, so that line numbers count them
        blank.append(head)
        head = next(first, b"")
    if not head.lstrip().startswith(b"["):
        yield from _records(itertools.chain(blank, [head], first), relative, formats)
        return
    text = head + stream.read(JSON_ARRAY_LIMIT)
    if len(text) > JSON_ARRAY_LIMIT:
        raise ValueError(
            f"{relative}: a JSON array over {JSON_ARRAY_LIMIT // 2**20} MB is read whole; write "
            "it as JSON Lines (one record per line, .jsonl) to stream it"
        )
    try:
        records = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{relative}: not a JSON array of records ({error})") from None
    del text
    for index, record in enumerate(records):
        yield Document((_field(record, formats, f"{relative}: record {index}"),), relative, index)


def _pyarrow(relative: Path, what: str):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"{relative}: reading {what} files needs pyarrow: {EXTRA}") from None
    return pyarrow


def _column(schema, relative: Path, formats: Formats) -> str:
    """The column of a table that holds the text field; ValueError listing the columns."""
    column = formats.text_field.split(".")[0]
    if column not in schema.names:
        raise ValueError(
            f"{relative}: no column {column!r} (its columns: {', '.join(schema.names)}); name "
            "the one that holds the text with --text-field"
        )
    return column


def _rows(batches, relative: Path, formats: Formats) -> Iterator[Document]:
    """The documents of a table's record batches of one column, one per row."""
    column = formats.text_field.split(".")[0]
    row = 0
    for batch in batches:
        for value in batch.column(0).to_pylist():
            text = _field({column: value}, formats, f"{relative}: row {row}")
            yield Document((text,), relative, row)
            row += 1


def _parquet(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    pyarrow = _pyarrow(relative, ".parquet")
    try:
        table = pyarrow.parquet.ParquetFile(stream.seekable_file())
    except pyarrow.ArrowInvalid as error:
        raise ValueError(f"{relative}: not a Parquet file ({error})") from None
    column = _column(table.schema_arrow, relative, formats)
    yield from _rows(table.iter_batches(ROWS, columns=[column]), relative, formats)


def _arrow(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    pyarrow = _pyarrow(relative, ".arrow")
    try:
        if stream.read(6) == b"ARROW1":  # the IPC file format, which seeks
            stream.file.seek(0)
            reader = pyarrow.ipc.open_file(stream.seekable_file())
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:  # the IPC stream format, as datasets.save_to_disk writes it
            stream.file.seek(0)
            reader = pyarrow.ipc.open_stream(stream.file)
            batches = iter(reader)
        column = _column(reader.schema, relative, formats)
        index = reader.schema.get_field_index(column)
        yield from _rows((batch.select([index]) for batch in batches), relative, formats)
    except pyarrow.ArrowInvalid as error:
        raise ValueError(f"{relative}: not an Arrow file ({error})") from None
