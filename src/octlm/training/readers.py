"""Corpus files -> documents: one small reader per format, chosen by the file's name.

A reader yields :class:`Document` s: a document's text as bytes in pieces (read as they are
consumed, so no file, and no long text, is ever held whole), the file it came from (relative to
the corpus root) and its index in that file (None where the file is one document). What
happens to the documents (the split, the tokenizer, the token files) is
:mod:`octlm.training.corpus` 's and :mod:`octlm.training.tokens` 's, one pipeline for every
format.

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

With a chat format (:attr:`Formats.chat_format`) a record is read whole, and its document is a
conversation (:mod:`octlm.training.conversations`): its messages, and no text. A record that
holds none is a bad record: a document with only a ``problem`` naming the file, the line (a JSON
array's record, a table's row) and what is wrong, for the pipeline to skip and count; with
``strict``, a ValueError. A text file holds no records, so no conversations: a ValueError.
"""

from __future__ import annotations

import bz2
import codecs
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
from pathlib import Path
from typing import NamedTuple

from octlm.chatml import Message
from octlm.training import conversations
from octlm.training.formats import Formats

BLOCK = 1 << 20  # bytes read at a time from a text file
JSON_ARRAY_LIMIT = 128 * 2**20  # a JSON array is parsed whole: beyond this, JSON Lines
ROWS = 1024  # rows of a Parquet file decoded at a time
ZSTD_PIECE = 1 << 16  # compressed bytes of a .zst file decompressed at a time (zstandard)
EXTRA = "pip install 'octlm[data]'"  # pyarrow, and zstandard where Python has no zstd
COMPRESSIONS = (".gz", ".zst", ".xz", ".bz2")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS |= {".arrow": "arrow"}
# What datasets.save_to_disk writes beside its .arrow files: descriptions, not documents.
DATASET_FILES = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
# Installed packages are not the standard library, wherever an interpreter keeps them.
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BRACES = re.compile(r"\{([^{}]*)\}")


class Document(NamedTuple):
    """One document of a corpus: a text, a conversation, or a bad record's problem.

    ``text`` yields its bytes in pieces and must be read through before the next document is
    asked for (the pieces of a long one come from the file as they are read). A conversation's
    and a bad record's are empty.
    """

    text: Iterable[bytes]
    source: Path  # its file, relative to the corpus root
    index: int | None  # its record (or part) in that file; None: the file is one document
    messages: list[Message] | None = None  # a conversation's, checked by chatml.messages_of
    problem: str | None = None  # a bad record's: "<file>: line N: <what is wrong>"


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


def estimated_text(path: Path, size: int) -> int:
    """About how many bytes of text a corpus file of ``size`` bytes on disk holds.

    An uncompressed file other than Parquet: ``size``. A compressed or Parquet file: the length
    its container records, read from a few bytes of it:

    - gzip: the trailer's length of the last member, kept modulo 4 GiB (plus the multiple of
      4 GiB that brings it nearest 4 times ``size``; never over 1032 times, deflate's limit);
    - zstd: the first frame's content size, where its header holds one;
    - xz: the sum of the uncompressed sizes in the last stream's index;
    - Parquet: the sum of its column chunks' sizes before compression, every column's.

    Where none is recorded (bz2), it cannot be read (the reader says why) or it is below
    ``size`` (a text is never shorter than its compressed file: the last of several members,
    the first of several frames), 4 times ``size``.
    """
    compression = compression_of(path)
    if compression is None and format_of(path) != "parquet":
        return size
    found = _recorded_length(path, size, compression)
    return found if found is not None and found >= size else 4 * size


def _recorded_length(path: Path, size: int, compression: str | None) -> int | None:
    """The length a compressed file's container records (``compression`` None: a Parquet
    file's columns before compression); None where none is recorded or it cannot be read."""
    lengths = {".gz": _gzip_length, ".zst": _zstd_length, ".xz": _xz_length}
    length = lengths.get(compression) if compression else _parquet_length
    if length is None:
        return None
    try:
        with open(path, "rb") as file:
            return length(file, size)
    except Exception:  # a damaged file, or no pyarrow: an estimate, which the reader checks
        return None


def _gzip_length(file, size: int) -> int | None:
    if file.read(2) != b"\x1f\x8b":
        return None
    file.seek(-4, os.SEEK_END)
    low = int.from_bytes(file.read(4), "little")  # ISIZE: the length modulo 2**32
    length = low + max(0, round((4 * size - low) / 2**32)) * 2**32
    return length if length <= 1032 * size else None  # deflate compresses 1032-fold at most


def _zstd_length(file, size: int) -> int | None:
    """The content size in a zstd frame header (RFC 8878 3.1.1.1), where it is written."""
    header = file.read(18)  # magic, descriptor, window, dictionary id, content size: at most
    if len(header) < 6 or header[:4] != b"\x28\xb5\x2f\xfd":
        return None
    descriptor = header[4]
    single = descriptor >> 5 & 1  # a single segment has no window byte
    width = (single, 2, 4, 8)[descriptor >> 6]
    start = 5 + (not single) + (0, 1, 2, 4)[descriptor & 3]
    field = header[start : start + width]
    if not width or len(field) < width:
        return None
    return int.from_bytes(field, "little") + (256 if width == 2 else 0)


def _xz_length(file, size: int) -> int | None:
    """The sum of the uncompressed sizes in the index of an xz file's last stream."""
    file.seek(-12, os.SEEK_END)
    footer = file.read(12)  # CRC32, the index's size / 4 - 1, flags, b"YZ"
    if footer[10:] != b"YZ":
        return None
    index_size = (int.from_bytes(footer[4:8], "little") + 1) * 4
    file.seek(-12 - index_size, os.SEEK_END)
    index = file.read(index_size)  # 0, count, (unpadded, uncompressed) each, padding, CRC32
    numbers = list(_varints(index[1:-4]))
    if index[:1] != b"\0" or not numbers or len(numbers) <= 2 * numbers[0]:
        return None
    return sum(numbers[2 : 2 * numbers[0] + 1 : 2])


def _varints(data: bytes) -> Iterator[int]:
    """The numbers of xz's variable-length encoding: 7 bits a byte, low first, high bit set
    on every byte but a number's last."""
    number = shift = 0
    for byte in data:
        number |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            yield number
            number = shift = 0


def _parquet_length(file, size: int) -> int:
    import pyarrow.parquet

    metadata = pyarrow.parquet.ParquetFile(file).metadata
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    return sum(g.column(i).total_uncompressed_size for g in groups for i in range(g.num_columns))


def is_whole(path: Path, formats: Formats) -> bool:
    """Whether a file is one document: a text file, when no separator cuts it."""
    return format_of(path) == "text" and formats.separator is None


def read(path: Path, relative: Path, formats: Formats) -> Iterator[Document]:
    """The documents of one corpus file, by its format; ValueError for a text file under a chat
    format."""
    if formats.chat_format is not None and format_of(path) == "text":
        raise ValueError(
            f"{relative}: a text file holds no conversations (--chat-format "
            f"{formats.chat_format} reads a conversation from each record of JSON Lines, JSON, "
            "Parquet or Arrow files); leave it out with --glob"
        )
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

    @property
    def closed(self) -> bool:  # with read, all pyarrow asks of a file it streams
        return self.file.closed

    def blocks(self) -> Iterator[bytes]:
        """The file's bytes, :data:`BLOCK` at a time."""
        while block := self.read(BLOCK):
            yield block

    def peek(self, size: int) -> bytes:
        """The next ``size`` bytes, left to be read (fewer at the end of the file, or where a
        compressed file's next piece decompresses to fewer)."""
        return self._reading(lambda: self.file.peek(size))[:size]

    def lines(self) -> Iterator[bytes]:
        """The file's lines, the first without the UTF-8 byte order mark that Windows tools
        write and JSON does not allow."""
        line = self._reading(self.file.readline).removeprefix(codecs.BOM_UTF8)
        while line:
            yield line
            line = self._reading(self.file.readline)

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
    return io.BufferedReader(_ZstdFrames(path, zstandard))  # which reads lines


class _ZstdFrames(io.RawIOBase):
    """A .zst file's bytes through zstandard, frame after frame. A file that ends inside a
    frame is an EOFError, as in gzip, lzma and bz2 (zstandard's own reader ends there as if
    the frame did)."""

    def __init__(self, path: Path, zstandard):
        self.file = open(path, "rb")  # noqa: SIM115 (closed with the reader)
        context = zstandard.ZstdDecompressor()
        self.frame = lambda: context.decompressobj(read_across_frames=False)  # one a frame
        self.decompressor = None  # the frame being read; None between frames
        self.left = b""  # read past the end of a frame: the next one's start
        self.held = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.held:
            data, self.left = self.left or self.file.read(ZSTD_PIECE), b""
            if not data:
                if self.decompressor is not None:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            if self.decompressor is None:
                self.decompressor = self.frame()
            self.held = memoryview(self.decompressor.decompress(data))
            if self.decompressor.eof:
                self.left, self.decompressor = self.decompressor.unused_data, None
        size = min(len(buffer), len(self.held))
        buffer[:size], self.held = self.held[:size], self.held[size:]
        return size

    def close(self) -> None:
        self.file.close()
        super().close()


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


def _document(record: object, formats: Formats, relative: Path, index: int, where: str) -> Document:
    """A record's document (``where``: the file and its line, record or row, for errors): the
    text of its field or, with a chat format, its conversation or a bad record's problem."""
    if formats.chat_format is None:
        return Document((_field(record, formats, where),), relative, index)
    try:
        messages = conversations.conversation(record, formats.chat_format)
    except ValueError as error:
        problem = f"{where}: {error}"
        if formats.strict:
            raise ValueError(f"{problem}; without --strict such records are skipped") from None
        return Document((), relative, index, problem=problem)
    return Document((), relative, index, messages=messages)


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
        yield _document(record, formats, relative, number - 1, f"{relative}: line {number}")


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
        yield _document(record, formats, relative, index, f"{relative}: record {index}")


def _pyarrow(relative: Path, what: str):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"{relative}: reading {what} files needs pyarrow: {EXTRA}") from None
    return pyarrow


def _columns(schema, relative: Path, formats: Formats) -> list[str]:
    """The columns of a table that its documents are read from: the one that holds the text
    field (ValueError listing the columns where there is none), or those of the chat format."""
    if formats.chat_format is not None:
        return conversations.columns(schema.names, formats.chat_format)
    column = formats.text_field.split(".")[0]
    if column not in schema.names:
        raise ValueError(
            f"{relative}: no column {column!r} (its columns: {', '.join(schema.names)}); name "
            "the one that holds the text with --text-field"
        )
    return [column]


def _rows(batches, relative: Path, formats: Formats) -> Iterator[Document]:
    """The documents of a table's record batches (of the columns they are read from), one per
    row; nested columns come as lists and dicts."""
    row = 0
    for batch in batches:
        for record in batch.to_pylist():  # {column: value} a row
            yield _document(record, formats, relative, row, f"{relative}: row {row}")
            row += 1


def _parquet(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    pyarrow = _pyarrow(relative, ".parquet")
    try:
        table = pyarrow.parquet.ParquetFile(stream.seekable_file())
    except pyarrow.ArrowInvalid as error:
        raise ValueError(f"{relative}: not a Parquet file ({error})") from None
    columns = _columns(table.schema_arrow, relative, formats)
    try:
        yield from _rows(table.iter_batches(ROWS, columns=columns), relative, formats)
    except (pyarrow.ArrowException, OSError) as error:  # a damaged page or row group
        raise ValueError(f"{relative}: not a Parquet file ({error})") from None


def _arrow(stream: _Stream, relative: Path, formats: Formats) -> Iterator[Document]:
    pyarrow = _pyarrow(relative, ".arrow")
    try:
        if stream.peek(6) == b"ARROW1":  # the IPC file format, read from its footer
            reader = pyarrow.ipc.open_file(stream.seekable_file())
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:  # the IPC stream format, as datasets.save_to_disk writes it
            reader = pyarrow.ipc.open_stream(stream)  # read as it is decompressed
            batches = iter(reader)
        columns = _columns(reader.schema, relative, formats)
        indices = [reader.schema.get_field_index(column) for column in columns]
        yield from _rows((batch.select(indices) for batch in batches), relative, formats)
    except (pyarrow.ArrowException, OSError) as error:  # pyarrow's own, of a short file
        raise ValueError(f"{relative}: not an Arrow file ({error})") from None
