"""A corpus opened once: its files, documents split whole by path or record hash, its tail
held out where it is one document."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from octlm.cli import main
from octlm.training import readers
from octlm.training.corpus import Corpus, default_corpus, held_out, path_fraction
from octlm.training.readers import SKIPPED_FOLDERS, find_files
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


def test_default_corpus_is_the_standard_library():
    root, glob = default_corpus()
    assert (root / "os.py").is_file() and glob == "**/*.py"
    found = find_files(root / "json", glob)
    assert root / "json" / "decoder.py" in found
    assert not any(SKIPPED_FOLDERS.intersection(p.parts) for p in found)


def test_a_start_opens_its_corpus_once(tmp_path, monkeypatch):
    """``octlm prepare`` and a new BPE run of ``octlm train`` (auto's choice, the BPE's text,
    the token writer, the change check) each find and stat the corpus's files once."""
    corpus = write_corpus(tmp_path / "corpus", documents=30, size=2000)
    opened, found, open_corpus, find = [], [], Corpus.open.__func__, readers.find_files

    def counted_open(cls, *args, **kwargs):
        opened.append(args)
        return open_corpus(cls, *args, **kwargs)

    def counted_find(*args, **kwargs):
        found.append(args)
        return find(*args, **kwargs)

    monkeypatch.setattr(Corpus, "open", classmethod(counted_open))
    monkeypatch.setattr(readers, "find_files", counted_find)
    tokens = ["prepare", "--data", str(corpus), "--out", str(tmp_path / "tokens")]
    assert main([*tokens, "--vocab-size", "300"]) == 0
    assert (len(opened), len(found)) == (1, 1)
    opened.clear(), found.clear()
    assert main([*tokens, "--vocab-size", "300"]) == 0  # up to date: checked, not rebuilt
    assert (len(opened), len(found)) == (1, 1)
    opened.clear(), found.clear()
    run = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "1"]
    run += ["--width", "16", "--n-layers", "1", "--n-heads", "2", "--length", "16"]
    run += ["--batch", "4", "--eval-batches", "1", "--sample-tokens", "4", "--vocab-size", "300"]
    assert main(run) == 0
    assert (len(opened), len(found)) == (1, 1)
