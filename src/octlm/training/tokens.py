"""A token folder: a corpus's documents encoded into one token file per split, memory-mapped.

Tokens are the bytes themselves (vocabulary 256), or the ids of the run's BPE
(:mod:`octlm.tokenizer`), which encodes each document on its own, so documents start on token
boundaries, and ends each with its end-of-text token (the head of a single file held out at its
tail is no end, and gets none); a window of the token stream that straddles two documents sees
where one ends, and a packed row predicts its documents' ends. They are written as they are made
to ``train.bin`` and ``val.bin`` as unsigned ints of the smallest width that holds the vocabulary
(uint8 for bytes, uint16 up to 65,536 tokens; the width is in ``data.json``'s ``dtype``) and read
back with ``torch.from_file``, a memory map: a corpus larger than memory costs only the pages
that batches touch. Beside each, ``train.starts.bin`` and ``val.starts.bin`` hold where each
document starts (int64 offsets, in tokens), for packed batches. Each file is written under a
temporary name and renamed once all are whole, so an error or a signal leaves no half-written
file and an earlier folder's files as they were.

A folder of conversations (a corpus read with a chat format) holds each conversation as one
document, rendered in ChatML (:mod:`octlm.chatml`) with no end-of-text token, cut at a turn
boundary to fit ``limit`` tokens (a packed row and its last target) or dropped where no answer
fits; ``{split}.mask.bin`` holds one uint8 per token, 1 where the token is a supervised target
(what an assistant says, and its end of turn). Bad records are counted, the first few named.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from octlm import chatml
from octlm.progress import scaled
from octlm.tokenizer import MAX_VOCAB, BPETokenizer, ByteTokenizer
from octlm.training.corpus import RULES, Corpus, Part

SPLITS = ("train", "val")
SUMMARY = "data.json"
STARTS = "{split}.starts.bin"
MASK = "{split}.mask.bin"  # a conversation folder's: 1 where a token is a supervised target
TOKEN_FILES = tuple(
    name.format(split=split) for split in SPLITS for name in ("{split}.bin", STARTS)
)
MASK_FILES = tuple(MASK.format(split=split) for split in SPLITS)
# Every file write_tokens may leave in its folder: a folder of nothing else is octlm's own.
OWN_FILES = frozenset(
    {SUMMARY, *TOKEN_FILES, *MASK_FILES}
    | {f".{name}.tmp" for name in (*TOKEN_FILES, *MASK_FILES, SUMMARY)}
)
NAMED = 5  # bad records named in a conversation folder's summary
# Token file widths, narrowest first, and the array typecode of each.
TOKEN_WIDTHS = {"uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32}
TYPECODES = {1: "B", 2: "H", 4: next(code for code in "IL" if array(code).itemsize == 4)}
BATCH_BYTES = 1 << 20  # short documents are encoded together, this many bytes at a time


def token_dtype(vocab_size: int) -> str:
    """The narrowest token file dtype that holds every id below ``vocab_size``."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, 2**32] for token files, got {vocab_size}")
    return next(
        name for name, dtype in TOKEN_WIDTHS.items() if vocab_size - 1 <= torch.iinfo(dtype).max
    )


def write_tokens(
    found: Corpus,
    folder: str | os.PathLike,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
    progress: Callable[[int], object] | None = None,
    limit: int | None = None,
) -> dict:
    """Write ``folder/train.bin`` and ``folder/val.bin`` from the corpus ``found``, encoded by
    ``tokenizer`` (default: bytes), telling ``progress`` each document's bytes once read,
    and where each document starts in them
    (``folder/train.starts.bin``, ``folder/val.starts.bin``); return the corpus's summary.

    The summary (also saved as ``folder/data.json``) counts documents, bytes and tokens per
    split and the empty documents skipped, names the tokenizer, its vocabulary and the token
    dtype, the split's rule, the formats' options and the corpus's files (names, sizes and
    modification times: its fingerprint). A corpus of conversations (its formats' chat format)
    is rendered in ChatML and cut to ``limit`` tokens (None: whole), with a mask file per split
    and the conversations' counts in the summary (see the module docstring). Raises ValueError
    for an empty corpus or an empty split, or a file that cannot be read as its format, naming
    it.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    folder = Path(folder)
    found.check_files()
    folder.mkdir(parents=True, exist_ok=True)
    summary = {
        "source": os.path.abspath(found.root),
        "glob": found.glob,
        "val_share": found.val_share,
    }
    summary |= {"split": found.rule, "formats": found.options, "empty_skipped": 0}
    summary |= {f"{split}_{what}": 0 for split in SPLITS for what in ("documents", "bytes")}
    summary |= {f"{split}_tokens": 0 for split in SPLITS}
    summary |= {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size}
    # the id that ends each document, or None (a conversation ends with its <|im_end|>)
    summary["end_token"] = None if found.formats.chat_format else tokenizer.end_token
    summary["dtype"] = token_dtype(tokenizer.vocab_size)
    summary["files"] = found.fingerprint
    chat = found.formats.chat_format is not None
    if chat:
        chatml.chat_ids(tokenizer)  # a tokenizer without chat tokens is refused first
        summary["chat"] = {"limit": limit, "cut": 0, "dropped": 0, "bad": 0, "named": []}
        summary["chat"] |= {f"{split}_supervised": 0 for split in SPLITS}
    names = (*TOKEN_FILES, *MASK_FILES) if chat else TOKEN_FILES
    typecode = TYPECODES[TOKEN_WIDTHS[summary["dtype"]].itemsize]
    writers = {split: _SplitWriter(folder, split, typecode, summary, chat) for split in SPLITS}
    try:
        try:
            told = progress or (lambda size: None)
            if chat:
                _write_conversations(found, tokenizer, writers, summary, told, limit)
            else:
                _write_splits(found, tokenizer, writers, summary, told)
        finally:
            for writer in writers.values():
                writer.close()
        _check_splits(found, summary)
        (folder / SUMMARY).unlink(missing_ok=True)  # an earlier folder's: its files go now
        for name in MASK_FILES:  # an earlier folder's masks, where these tokens have none
            (folder / name).unlink(missing_ok=True)
        for name in names:
            os.replace(folder / f".{name}.tmp", folder / name)
        write_summary(folder, summary)
    except BaseException:  # nothing half-written stays behind
        for name in names:
            (folder / f".{name}.tmp").unlink(missing_ok=True)
        raise
    return summary


def write_summary(folder: Path, summary: dict) -> None:
    """Write ``folder/data.json`` under a temporary name, then rename it into place."""
    temporary = folder / f".{SUMMARY}.tmp"
    temporary.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(temporary, folder / SUMMARY)


class _SplitWriter:
    """One split's token and offset files, written as documents come, under temporary names."""

    def __init__(self, folder: Path, split: str, typecode: str, summary: dict, masked: bool):
        self.split, self.typecode, self.summary = split, typecode, summary
        self.tokens = (folder / f".{split}.bin.tmp").open("wb")
        self.starts = (folder / f".{STARTS.format(split=split)}.tmp").open("wb")
        self.mask = (folder / f".{MASK.format(split=split)}.tmp").open("wb") if masked else None

    def write(
        self,
        pieces: Iterable,
        size: int,
        end_token: int | None,
        supervised: list[bool] | None = None,
    ) -> None:
        """One document (or its head or tail) of ``size`` bytes, from its tokens in
        ``pieces``, then ``end_token`` (None: no end); a conversation with the ``supervised``
        flag of each token."""
        count = f"{self.split}_tokens"
        self.starts.write(array("q", [self.summary[count]]))
        if supervised is not None:
            self.mask.write(bytes(supervised))
            self.summary["chat"][f"{self.split}_supervised"] += sum(supervised)
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
        if self.mask is not None:
            self.mask.close()


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


def _write_conversations(
    found: Corpus, tokenizer, writers: dict, summary: dict, progress, limit: int | None
) -> None:
    """Render each conversation into its split's writer, cut to ``limit`` tokens; count the
    cut, the dropped and the bad records (naming the first :data:`NAMED`)."""
    chat = summary["chat"]
    for part in found.parts():
        if part.problem is not None:
            chat["bad"] += 1
            if len(chat["named"]) < NAMED:
                chat["named"].append(part.problem)
            continue
        whole = chatml.render(tokenizer, part.messages)
        rendered = whole if limit is None else chatml.cut(whole, part.messages, limit)
        if rendered is None:
            chat["dropped"] += 1
            continue
        chat["cut"] += rendered is not whole
        size = len(tokenizer.decode(rendered.ids))
        writers[part.split].write([rendered.ids], size, None, rendered.supervised)
        progress(size)


def _chain(first: bytes, second: bytes | None, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    if second is not None:
        yield second
        yield from rest


def _check_splits(found: Corpus, summary: dict) -> None:
    """Raise ValueError for a corpus of no text, or a split without any."""
    chat = summary.get("chat")
    if chat is not None and not summary["train_documents"] + summary["val_documents"]:
        named = f"; {chat['named'][0]}" if chat["named"] else ""
        raise ValueError(
            f"data {str(found.root)!r}: no conversation to train on ({chat['bad']} bad records, "
            f"{chat['dropped']} with no answer within {chat['limit']} tokens){named}"
        )
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


def describe(summary: dict) -> str:
    """One line on a token folder: its corpus, documents (and empty ones skipped), bytes,
    tokens, and the split."""
    documents = summary["train_documents"] + summary["val_documents"]
    size = summary["train_bytes"] + summary["val_bytes"]
    count = summary["train_tokens"] + summary["val_tokens"]
    skipped = f", {summary['empty_skipped']:,} empty skipped" if summary["empty_skipped"] else ""
    kind = "bytes"
    if summary["tokenizer"] != "bytes":
        each = summary["train_bytes"] / max(summary["train_tokens"], 1)
        kind = f"{summary['tokenizer']} of {summary['vocab_size']:,}, {each:.2f} bytes each"
    chat = summary.get("chat")
    if chat is not None:
        return _described_conversations(summary, chat, kind)
    return (
        f"data {summary['source']} ({summary['glob']}): {documents:,} documents{skipped}, "
        f"{scaled(size)}B -> {count:,} tokens ({kind}); validation "
        f"{summary['val_documents']:,} documents, {100 * held_out_share(summary):.1f}% of "
        f"bytes (--val-share {summary['val_share']}) by "
        f"{RULES.get(summary.get('split', 'file'), 'a hash of each file')}"
    )


def _described_conversations(summary: dict, chat: dict, kind: str) -> str:
    """:func:`describe` for a folder of conversations: how many, the supervised tokens and the
    share held out, what was cut, dropped or skipped as bad."""
    count = summary["train_documents"] + summary["val_documents"]
    supervised = chat["train_supervised"] + chat["val_supervised"]
    held = chat["val_supervised"] / max(supervised, 1)
    within = f"{chat['limit']:,} tokens" if chat["limit"] else "the rows"
    lines = [
        f"data {summary['source']} ({summary['glob']}): {count:,} conversations, "
        f"{summary['train_tokens'] + summary['val_tokens']:,} tokens ({kind}), "
        f"{supervised:,} of them supervised; validation {summary['val_documents']:,} "
        f"conversations, {100 * held:.1f}% of supervised tokens (--val-share "
        f"{summary['val_share']})",
        f"  {chat['cut']:,} cut at a turn boundary to fit {within}, {chat['dropped']:,} dropped "
        f"(no whole answer fits), {chat['bad']:,} bad records skipped",
    ]
    lines += [f"  bad record: {problem}" for problem in chat["named"]]
    if chat["bad"] > len(chat["named"]):
        lines.append(f"  ... and {chat['bad'] - len(chat['named']):,} more (--strict refuses)")
    return "\n".join(lines)


def load_mask(folder: str | os.PathLike, split: str) -> Tensor | None:
    """Whether each token of one split is a supervised target ``(N,)`` uint8, memory-mapped;
    None for a folder of plain documents."""
    summary = read_summary(folder) or {}
    if summary.get("chat") is None:
        return None
    path = _checked_file(Path(folder), MASK.format(split=split), summary[f"{split}_tokens"])
    return torch.from_file(
        str(path), shared=False, size=summary[f"{split}_tokens"], dtype=torch.uint8
    )


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
        summary["dtype"] not in TOKEN_WIDTHS
        or not isinstance(summary["tokenizer"], str)
        or not all(isinstance(value, int) and value >= 0 for value in numbers)
    ):
        raise ValueError(
            f"{str(path)!r} is damaged (expected tokenizer, vocab_size, dtype among "
            f"{', '.join(TOKEN_WIDTHS)} and token counts); start the run again"
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
    dtype = TOKEN_WIDTHS[summary.get("dtype", "uint8")]
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
