"""Batches: shifted windows that resume from their state, evaluation batches over the whole
split, packed rows of whole documents."""

from __future__ import annotations

import bisect

import pytest
import torch

from octlm.training.batches import IGNORED, Batches, PackedBatches, evaluation_batches
from octlm.training.tokens import load_tokens
from tests.training_helpers import write_tokens


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
