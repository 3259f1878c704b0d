"""Corpus formats: each record its own document, split by its hash, read streaming; bad input
as one line naming the file, the line or row and the field."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import itertools
import json
import lzma
import os
import sys
from pathlib import Path

import pytest

from octlm.tokenizer import BPETokenizer
from octlm.training import readers
from octlm.training.corpus import Corpus, default_corpus, record_fraction
from octlm.training.formats import DEFAULT_GLOB, Formats
from octlm.training.readers import find_files
from octlm.training.tokens import load_starts, load_tokens
from tests.training_helpers import write_tokens

RECORDS = [f"story {i}: once upon a time there was a fox number {i}." for i in range(40)]


def jsonl(records, field="text") -> bytes:
    return b"".join(json.dumps({field: r, "id": i}).encode() + b"\n" for i, r in enumerate(records))


def tokens_of(folder: Path, split: str) -> bytes:
    return (folder / f"{split}.bin").read_bytes()


def expected_split(name: str, records: list[str], share: float = 0.1) -> dict[str, list[bytes]]:
    """The records of each split by the record rule, in file order."""
    found = {"train": [], "val": []}
    for index, record in enumerate(records):
        held = record_fraction(Path(name), index) < share
        found["val" if held else "train"].append(record.encode("utf-8", "surrogatepass"))
    return found


def write_compressed(path: Path, payload: bytes) -> Path:
    openers = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
    if path.suffix == ".zst":
        zstandard = pytest.importorskip("zstandard")
        path.write_bytes(zstandard.ZstdCompressor().compress(payload))
    elif path.suffix in openers:
        with openers[path.suffix](path, "wb") as out:
            out.write(payload)
    else:
        path.write_bytes(payload)
    return path


@pytest.mark.parametrize("suffix", ["", ".gz", ".xz", ".bz2", ".zst"])
@pytest.mark.parametrize("name", ["corpus.jsonl", "corpus.ndjson", "corpus.json"])
def test_each_json_line_is_a_document_split_by_its_hash(tmp_path, name, suffix):
    file = write_compressed(tmp_path / (name + suffix), jsonl(RECORDS))
    summary = write_tokens(file, DEFAULT_GLOB, 0.1, tmp_path / "tokens")
    expected = expected_split(file.name, RECORDS)
    assert summary["split"] == "record" and 0 < len(expected["val"]) < len(RECORDS)
    for split, texts in expected.items():
        assert tokens_of(tmp_path / "tokens", split) == b"".join(texts)
        sizes = [len(t) for t in texts]
        starts = load_starts(tmp_path / "tokens", split).tolist()
        assert starts == [sum(sizes[:i]) for i in range(len(sizes))]


def test_a_json_array_and_nested_fields(tmp_path):
    records = [{"meta": {"body": r}, "n": i} for i, r in enumerate(RECORDS)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    formats = Formats(text_field="meta.body")
    write_tokens(tmp_path / "a.json", "*", 0.1, tmp_path / "t", formats=formats)
    expected = expected_split("a.json", RECORDS)
    assert tokens_of(tmp_path / "t", "train") == b"".join(expected["train"])


def test_a_json_array_beyond_the_limit_is_refused_naming_json_lines(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text(json.dumps([{"text": r} for r in RECORDS]))
    monkeypatch.setattr(readers, "JSON_ARRAY_LIMIT", 100)
    with pytest.raises(ValueError, match=r"a.json: a JSON array over .* JSON Lines"):
        write_tokens(tmp_path / "a.json", "*", 0.1, tmp_path / "t")


def test_record_split_does_not_depend_on_other_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_bytes(jsonl(RECORDS))
    first = write_tokens(shards, DEFAULT_GLOB, 0.2, tmp_path / "one")
    (shards / "b.jsonl").write_bytes(jsonl(RECORDS[:5]))
    write_tokens(shards, DEFAULT_GLOB, 0.2, tmp_path / "two")
    held = tokens_of(tmp_path / "one", "val")
    assert first["val_documents"] and tokens_of(tmp_path / "two", "val").startswith(held)


def test_parquet_by_column_and_arrow_as_datasets_writes_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(RECORDS))), "content": RECORDS})
    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(table, folder / "train-00000.parquet", row_group_size=7)
    with pa.ipc.new_stream(folder / "data-00000-of-00001.arrow", table.schema) as out:
        for batch in table.to_batches(max_chunksize=9):
            out.write_batch(batch)
    (folder / "state.json").write_text('{"_data_files": []}')  # datasets' description
    summary = write_tokens(
        folder, DEFAULT_GLOB, 0.1, tmp_path / "t", formats=Formats(text_field="content")
    )
    assert summary["train_documents"] + summary["val_documents"] == 2 * len(RECORDS)
    expected = [
        expected_split(name, RECORDS)
        for name in ("data-00000-of-00001.arrow", "train-00000.parquet")
    ]
    assert tokens_of(tmp_path / "t", "val") == b"".join(b"".join(e["val"]) for e in expected)


def test_a_separator_cuts_a_text_file_into_documents(tmp_path):
    stories = [f"Story {i}.\nThe end." for i in range(30)]
    text = "\n<|endoftext|>\n".join(stories) + "\n<|endoftext|>\n"
    (tmp_path / "tiny.txt").write_text(text)
    formats = Formats(separator="<|endoftext|>")
    summary = write_tokens(tmp_path / "tiny.txt", "*", 0.1, tmp_path / "t", formats=formats)
    assert summary["train_documents"] + summary["val_documents"] == 30
    expected = expected_split("tiny.txt", stories)
    assert tokens_of(tmp_path / "t", "train") == b"".join(expected["train"])


def test_separated_parts_are_the_same_read_in_any_block_size(tmp_path, monkeypatch):
    text = b"a\r\n<s>\r\nbb\n<s>\n<s>ccc<s>\n" + b"d" * 50 + b"\n<s>"
    (tmp_path / "f.txt").write_bytes(text)
    for block in (1, 2, 3, 7, 1 << 20):
        monkeypatch.setattr(readers, "BLOCK", block)
        found = [
            b"".join(d.text)
            for d in readers.read(tmp_path / "f.txt", Path("f.txt"), Formats(separator="<s>"))
        ]
        assert found == [b"a", b"bb", b"", b"ccc", b"d" * 50], block


def test_a_single_compressed_file_holds_out_its_tail(tmp_path):
    text = bytes(range(256)) * 40
    file = write_compressed(tmp_path / "one.txt.gz", text)
    summary = write_tokens(file, "*", 0.25, tmp_path / "t")
    cut = len(text) - int(len(text) * 0.25)
    assert summary["split"] == "tail"
    assert tokens_of(tmp_path / "t", "train") + tokens_of(tmp_path / "t", "val") == text
    assert len(tokens_of(tmp_path / "t", "train")) == cut


def old_held_out(root: Path, files: list[Path], share: float) -> set[str]:
    """The split by path as octlm made it before corpora had formats, verbatim in effect."""

    def fraction(relative: str) -> float:
        digest = hashlib.sha256(os.fsencode(relative)).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    relatives = [f.relative_to(root).as_posix() for f in files if f.stat().st_size]
    ranked = sorted(relatives, key=fraction)
    chosen = {r for r in ranked if fraction(r) < share}
    if len(ranked) >= 2 and not chosen:
        chosen = {ranked[0]}
    if len(ranked) >= 2 and len(chosen) == len(ranked):
        chosen.discard(ranked[-1])
    return chosen


def test_the_default_corpus_splits_as_it_always_has(tmp_path):
    root, glob = default_corpus()
    files = find_files(root, glob)
    expected = old_held_out(root, files, 0.1)
    found = Corpus.open(root, glob, 0.1)
    assert found.rule == "file" and {p.as_posix() for p in found.validation} == expected
    summary = write_tokens(root, glob, 0.1, tmp_path / "t")
    held = [f for f in files if f.relative_to(root).as_posix() in expected]
    assert summary["val_documents"] == len(held)
    assert summary["val_bytes"] == sum(f.stat().st_size for f in held)


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [b'{"text": "a"}', b'{"body": "b"}'],
            r"c.jsonl: line 2: no field 'text' \(it has 'body'\)",
        ),
        ([b'{"text": "a"}', b'{"text": 3}'], r"c.jsonl: line 2: field 'text' holds int '3'"),
        ([b'{"text": "a"}', b"", b'{"text": "b"'], r"c.jsonl: line 3 is not JSON"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, records, message):
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(records) + b"\n")
    with pytest.raises(ValueError, match=message):
        write_tokens(tmp_path / "c.jsonl", "*", 0.1, tmp_path / "t")


def test_a_parquet_without_the_column_lists_its_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1], "content": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(
        ValueError, match=r"p.parquet: no column 'text' \(its columns: id, content\)"
    ):
        write_tokens(tmp_path / "p.parquet", "*", 0.1, tmp_path / "t")


def test_a_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ValueError, match=r"p.parquet: reading .parquet files needs pyarrow: pip "):
        write_tokens(tmp_path / "p.parquet", "*", 0.1, tmp_path / "t")


def test_an_unreadable_compressed_file_names_it_and_the_earlier_tokens_stay(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(RECORDS))
    write_tokens(tmp_path / "a.jsonl", "*", 0.1, tmp_path / "t")
    before = {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()}
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(RECORDS))[:-30])  # cut short
    with pytest.raises(ValueError, match=r"b.jsonl.gz \(gz-compressed\): cannot be read"):
        write_tokens(tmp_path / "b.jsonl.gz", "*", 0.1, tmp_path / "t")
    assert {p.name: p.read_bytes() for p in (tmp_path / "t").iterdir()} == before


def test_empty_records_are_skipped_and_counted(tmp_path):
    records = [*RECORDS, "", None]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    summary = write_tokens(tmp_path / "a.jsonl", "*", 0.1, tmp_path / "t")
    assert summary["empty_skipped"] == 2
    assert summary["train_documents"] + summary["val_documents"] == len(RECORDS)


def test_bpe_tokens_of_records_equal_encoding_each_alone(tmp_path):
    tokenizer = BPETokenizer.train([" ".join(RECORDS).encode()], 300)
    (tmp_path / "a.jsonl").write_bytes(jsonl([*RECORDS, "caf\u00e9 \ud800 odd"]))
    write_tokens(tmp_path / "a.jsonl", "*", 0.1, tmp_path / "t", tokenizer)
    tokens = load_tokens(tmp_path / "t", "train", 1).tolist()
    expected = []
    for text in expected_split("a.jsonl", [*RECORDS, "caf\u00e9 \ud800 odd"])["train"]:
        expected += [*tokenizer.encode(text), tokenizer.end_token]
    assert tokens == expected


def test_a_compressed_file_of_no_text_is_said_empty(tmp_path):
    file = write_compressed(tmp_path / "one.txt.gz", b"")
    with pytest.raises(ValueError, match=r"one.txt.gz': its text is empty$"):
        write_tokens(file, "*", 0.1, tmp_path / "t")


COMPRESSIONS = [".gz", ".xz", ".bz2", ".zst"]


def documents(path: Path, formats: Formats | None = None) -> list[bytes]:
    """The texts ``readers.read`` gives for one file, read through."""
    return [b"".join(d.text) for d in readers.read(path, Path(path.name), formats or Formats())]


@pytest.mark.parametrize("suffix", COMPRESSIONS)
def test_a_compressed_file_cut_short_is_an_error_naming_it(tmp_path, suffix):
    """A shard that ends inside its compressed stream is refused naming it, never read as a
    shorter one (zstandard's own reader gives the blocks it holds whole, as if the file ended
    there)."""
    file = write_compressed(
        tmp_path / f"c.jsonl{suffix}", jsonl([f"r {i}" * 40 for i in range(1000)])
    )
    file.write_bytes(file.read_bytes()[: file.stat().st_size * 2 // 3])
    with pytest.raises(
        ValueError, match=rf"c.jsonl{suffix} \({suffix[1:]}-compressed\): cannot be read"
    ):
        write_tokens(file, "*", 0.1, tmp_path / "t")
    with pytest.raises(
        ValueError, match=rf"c.jsonl{suffix} \({suffix[1:]}-compressed\): cannot be read"
    ):
        readers.text_length(file)


def test_a_zst_file_of_several_frames_reads_whole(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    payload = jsonl(RECORDS)
    cuts = [0, 1, 700, 2000, len(payload)]  # frames that end mid-line, one of a single byte
    frames = [payload[a:b] for a, b in itertools.pairwise(cuts)]
    compress = zstandard.ZstdCompressor().compress
    (tmp_path / "c.jsonl.zst").write_bytes(b"".join(map(compress, frames)))
    assert documents(tmp_path / "c.jsonl.zst") == [r.encode() for r in RECORDS]
    assert readers.text_length(tmp_path / "c.jsonl.zst") == len(jsonl(RECORDS))


def arrow_bytes(table, layout: str) -> bytes:
    """``table`` as an Arrow IPC stream (as datasets writes it) or IPC file, in batches of 9."""
    pa = pytest.importorskip("pyarrow")
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream if layout == "stream" else pa.ipc.new_file
    with writer(sink, table.schema) as out:
        out.write_table(table, max_chunksize=9)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("suffix", ["", *COMPRESSIONS])
@pytest.mark.parametrize("layout", ["stream", "file"])
def test_a_compressed_arrow_file_reads_as_the_plain_one_in_both_layouts(tmp_path, layout, suffix):
    pa = pytest.importorskip("pyarrow")
    payload = arrow_bytes(pa.table({"id": list(range(len(RECORDS))), "text": RECORDS}), layout)
    file = write_compressed(tmp_path / f"d.arrow{suffix}", payload)
    assert documents(file) == [r.encode() for r in RECORDS]


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
@pytest.mark.parametrize("layout", ["stream", "file"])
def test_a_damaged_arrow_file_is_an_error_naming_it(tmp_path, layout, suffix):
    """An Arrow file cut short, plain or compressed, is refused naming it (pyarrow says an IPC
    stream a third long is an OSError, a file an ArrowInvalid)."""
    pa = pytest.importorskip("pyarrow")
    payload = arrow_bytes(pa.table({"text": RECORDS}), layout)
    file = write_compressed(tmp_path / f"d.arrow{suffix}", payload[: len(payload) // 3])
    with pytest.raises(ValueError, match=rf"^d.arrow{suffix}\b"):
        documents(file)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("pretty.json", json.dumps([{"text": r} for r in RECORDS], indent=2)),
        ("one-line.json", json.dumps([{"text": r} for r in RECORDS])),
        ("lines.json", jsonl(RECORDS).decode()),
        ("lines.jsonl", jsonl(RECORDS).decode()),
    ],
)
def test_a_byte_order_mark_before_json_is_read_past(tmp_path, name, text):
    """Windows tools start a UTF-8 file with a byte order mark: an array, pretty-printed or on
    one line, and JSON Lines read the same with it as without."""
    (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert documents(tmp_path / name) == [r.encode() for r in RECORDS]


def compressible_file(folder: Path, suffix: str) -> tuple[Path, int]:
    """A file of JSON Lines (or a Parquet table) whose text compresses 50-fold or more, and the
    bytes of text it holds."""
    records = [f"{i:05} " + "all work and no play " * 50 for i in range(400)]
    if suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": records}), folder / "c.parquet", compression="zstd")
        return folder / "c.parquet", sum(map(len, records))
    payload = jsonl(records)
    return write_compressed(folder / f"c.jsonl{suffix}", payload), len(payload)


@pytest.mark.parametrize("suffix", [".gz", ".xz", ".zst", ".parquet"])
def test_the_text_estimate_reads_what_the_container_records(tmp_path, suffix):
    """A compressed or Parquet file is estimated from the length it records (the text within
    10%), not 4 times its size: here the text is over 50 times the file."""
    file, text = compressible_file(tmp_path, suffix)
    assert file.stat().st_size * 50 < text
    assert text <= readers.estimated_text(file, file.stat().st_size) <= text * 1.1


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("c.jsonl.gz", b"\x1f\x8b" + b"not gzip" * 10),
        ("c.jsonl.gz", gzip.compress(jsonl(RECORDS)) + gzip.compress(b"x")),  # last member tiny
        ("c.jsonl.zst", b"not zstd" * 10),
        ("c.jsonl.xz", b"not xz at all" * 10),
        ("c.jsonl.bz2", bz2.compress(jsonl(RECORDS))),
        ("c.parquet", b"PAR1 not parquet PAR1"),
    ],
)
def test_the_text_estimate_is_four_times_a_file_it_cannot_read_the_length_of(
    tmp_path, name, payload
):
    """Where the container records no length (bz2), or a damaged or partial one, the estimate
    is 4 times the file's size, and says nothing of the damage (the reader does)."""
    (tmp_path / name).write_bytes(payload)
    assert readers.estimated_text(tmp_path / name, len(payload)) == 4 * len(payload)


def test_a_parquet_file_damaged_past_its_footer_is_an_error_naming_it(tmp_path):
    """Bytes of a row group overwritten (the footer intact): an error that names the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"record {i} " * 40 for i in range(200)]})
    pq.write_table(table, tmp_path / "p.parquet", compression="none")
    data = bytearray((tmp_path / "p.parquet").read_bytes())
    data[8:2000] = b"\xff" * 1992
    (tmp_path / "p.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^p\.parquet: "):
        write_tokens(tmp_path / "p.parquet", "*", 0.1, tmp_path / "t")
