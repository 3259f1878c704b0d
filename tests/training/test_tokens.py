"""A token folder: memory-mapped tokens, and where each document starts in them."""

from __future__ import annotations

import torch

from octlm.training.corpus import path_fraction
from octlm.training.readers import find_files
from octlm.training.tokens import load_starts, load_tokens
from tests.training_helpers import write_tokens


def test_tokens_are_memory_mapped_bytes(corpus, tmp_path):
    write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = load_tokens(tmp_path / "tokens", "train", 16)
    assert tokens.dtype == torch.uint8
    assert bytes(tokens.tolist()) == (tmp_path / "tokens" / "train.bin").read_bytes()


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
