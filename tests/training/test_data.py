"""Training data: documents split whole by path, memory-mapped byte tokens, batches and packed rows.

Runs use a model of a few thousand parameters on a few kilobytes of generated text
(tests/training_helpers.py), so each takes about a second.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path

import pytest
import torch

from octlm.training.batches import IGNORED, Batches, PackedBatches, evaluation_batches
from octlm.training.corpus import default_corpus, held_out, path_fraction
from octlm.training.readers import SKIPPED_FOLDERS, find_files
from octlm.training.tokens import load_starts, load_tokens
from tests.training_helpers import write_corpus, write_tokens


def test_documents_go_whole_to_one_split_by_path_hash(corpus, tmp_path):
    summary = write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    documents = find_files(corpus, "**/*.txt")
    held_out = [d for d in documents if path_fraction(d.relative_to(corpus)) < 0.3]
    assert 0 < len(held_out) < len(documents)
    for split, chosen in (
        ("val", held_out),
        ("train", [d for d in documents if d not in held_out]),
    ):
        expected = b"".join(d.read_bytes() for d in chosen)  # sorted order, as written
        assert (tmp_path / "tokens" / f"{split}.bin").read_bytes() == expected
        assert summary[f"{split}_documents"] == len(chosen)
        assert summary[f"{split}_bytes"] == len(expected)


def test_a_file_name_that_is_not_utf8_gets_a_place_in_the_split():
    """Its bytes are hashed as they are; UTF-8 names keep the place they always had."""
    odd = Path(os.fsdecode(b"src/f\xff.txt"))
    assert 0 <= path_fraction(odd) < 1
    named = Path("src/é.txt")
    digest = hashlib.sha256("src/é.txt".encode()).digest()
    assert path_fraction(named) == int.from_bytes(digest[:8], "big") / 2**64


def test_split_does_not_depend_on_where_the_corpus_lies(corpus, tmp_path):
    moved = write_corpus(tmp_path / "elsewhere" / "copy")
    first = write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "a")
    second = write_tokens(moved, "**/*.txt", 0.3, tmp_path / "b")
    where = ("source", "files")  # the files' times differ, not their names or sizes
    assert {k: v for k, v in first.items() if k not in where} == {
        k: v for k, v in second.items() if k not in where
    }
    assert [f[:2] for f in first["files"]] == [f[:2] for f in second["files"]]


@pytest.mark.parametrize("val_share", [1e-9, 0.999999999])
def test_small_corpus_still_gets_both_splits(val_share):
    relatives = [Path(f"doc{i}.txt") for i in range(3)]
    ranked = sorted(relatives, key=path_fraction)
    chosen = held_out(relatives, val_share)
    expected = {ranked[0]} if val_share < 0.5 else set(ranked[:2])
    assert chosen == expected


def test_single_file_holds_out_its_tail(tmp_path):
    text = bytes(range(256)) * 4
    (tmp_path / "one.txt").write_bytes(text)
    write_tokens(tmp_path / "one.txt", "**/*.txt", 0.25, tmp_path / "tokens")
    assert (tmp_path / "tokens" / "train.bin").read_bytes() == text[:768]
    assert (tmp_path / "tokens" / "val.bin").read_bytes() == text[768:]


def test_tokens_are_memory_mapped_bytes(corpus, tmp_path):
    write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = load_tokens(tmp_path / "tokens", "train", 16)
    assert tokens.dtype == torch.uint8
    assert bytes(tokens.tolist()) == (tmp_path / "tokens" / "train.bin").read_bytes()


def test_default_corpus_is_the_standard_library():
    root, glob = default_corpus()
    assert (root / "os.py").is_file() and glob == "**/*.py"
    found = find_files(root / "json", glob)
    assert root / "json" / "decoder.py" in found
    assert not any(SKIPPED_FOLDERS.intersection(p.parts) for p in found)


def test_batches_are_shifted_windows_and_resume_from_their_state(corpus, tmp_path):
    write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = load_tokens(tmp_path / "tokens", "train", 16)
    batches = Batches(tokens, 16, seed=3)
    inputs, targets, document_ids = batches.next(5)  # (5, 16) each
    assert inputs.shape == targets.shape == (5, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and document_ids is None
    state = batches.state_dict()
    expected = batches.next(5)
    again = Batches(tokens, 16, seed=99)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.next(5)[:2], expected[:2], strict=True))


def test_evaluation_batches_span_the_split(corpus, tmp_path):
    write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = load_tokens(tmp_path / "tokens", "val", 16)
    found = evaluation_batches(tokens, 16, batch=4, count=3)
    assert len(found) == 3 and all(batch.inputs.shape == (4, 16) for batch in found)
    assert torch.equal(found[0][0][0], tokens[:16].long())  # the first window starts at 0
    assert torch.equal(found[-1][1][-1], tokens[-16:].long())  # the last target is the end


def test_evaluation_batches_of_a_split_past_float32s_integers_end_at_its_end():
    """31,309,852 tokens: float32 would round the last start up, past the split's end."""
    tokens = torch.arange(31_309_852, dtype=torch.int32)  # (N,) each token its own place
    found = evaluation_batches(tokens, 128, batch=16, count=16)
    assert int(found[-1].targets[-1, -1]) == len(tokens) - 1  # the last target is the end


def test_tokens_record_where_documents_start(corpus, tmp_path):
    write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    documents = find_files(corpus, "**/*.txt")
    held_out = [d for d in documents if path_fraction(d.relative_to(corpus)) < 0.3]
    for split, chosen in (
        ("val", held_out),
        ("train", [d for d in documents if d not in held_out]),
    ):
        sizes = [d.stat().st_size for d in chosen]
        expected = [sum(sizes[:index]) for index in range(len(sizes))]
        assert load_starts(tmp_path / "tokens", split).tolist() == expected


@pytest.mark.parametrize("length", [4, 7])
def test_packed_rows_hold_whole_documents_or_row_sized_pieces(length):
    # Tokens are their own positions, so every row shows where it was cut from.
    sizes = [1, 3, 9, 2, 1, 5, 17, 4, 8]  # one-token documents, and ones longer than a row
    starts = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))])
    ends = [s + n for s, n in zip(starts.tolist(), sizes, strict=True)]
    tokens = torch.arange(sum(sizes))
    batches = PackedBatches(tokens, length, seed=0, starts=starts)
    inputs, targets, document_ids = batches.next(200)  # (200, length) each
    pieces = set()
    for row, (line, target, ids) in enumerate(zip(inputs, targets, document_ids, strict=True)):
        start = int(line[0])
        first = bisect.bisect_right(starts.tolist(), start) - 1
        assert (start - starts[first]) % length == 0 and start < ends[first] - 1, row
        pieces.add(start)
        window = [min(start + j, len(tokens) - 1) for j in range(length + 1)]
        assert line.tolist() == window[:-1]
        assert ids.tolist() == [bisect.bisect_right(ends, start + j) for j in range(length)]
        for j in range(length):  # a target counts iff it stays in a whole document (or piece)
            document = bisect.bisect_right(ends, start + j)
            whole = document == first or ends[document] <= start + length + 1
            counted = whole and start + j + 1 < ends[document]
            assert int(target[j]) == (start + j + 1 if counted else IGNORED), (row, j)
    expected_pieces = {
        s + k * length for s, n in zip(starts.tolist(), sizes, strict=True)
        for k in range(-(-(n - 1) // length))
    }  # fmt: skip
    assert pieces == expected_pieces  # 200 rows draw every piece of this corpus
