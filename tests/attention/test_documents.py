"""Packed documents and left padding: ``document_ids`` and ``key_starts`` in every
single-process implementation, against the independent float64 reference.

Forward outputs are judged by docs/design.md, 'When are two results equal' with factor 2, gradients
with factor 3, and the tiled log-sum-exp against the reference's. The last tests count the block
pairs tiled visits: skipping must really happen, and blocks inside one document need no document
mask.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from octlm.attention import naive_attention, tiled_attention
from tests.helpers import (
    assert_judged,
    assert_like_reference,
    implementations_with,
    make_qkv,
    reference,
    tiled,
)

BLOCKS = [1, 16, 64, 100, (16, 64), (100, 7), (512, 256)]


def documents(lengths_per_row: list[list[int]]) -> Tensor:
    """Document ids ``(batch, sum of lengths)``: row ``b`` packs documents of the given
    lengths, numbered from 0."""
    rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            for lengths in lengths_per_row]  # fmt: skip
    return torch.stack(rows)


# (documents per batch row, q_len): lengths of one, documents crossing every block edge,
# one document for the whole row, and a chunk of queries after a cache (q_len < k_len).
LAYOUTS = {
    "ones": ([[1] * 70, [1] * 35 + [35]], 70),
    "crossing": ([[13, 40, 1, 29, 17], [50, 50]], 100),
    "single": ([[90], [45, 45]], 90),
    "cache": ([[60, 1, 59], [7, 73, 40]], 37),
}


def inputs(layout: str, dtype=torch.float32, seed=0):
    lengths, q_len = LAYOUTS[layout]
    ids = documents(lengths)
    query, key, value = make_qkv(q_len=q_len, k_len=ids.shape[1], dtype=dtype, seed=seed)
    return query, key, value, ids


# Every registered implementation that takes the keyword, tiled with small blocks.
SINGLE_PROCESS = implementations_with("document_ids")


@pytest.mark.parametrize("name", SINGLE_PROCESS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_documents_match_reference(name, layout, causal):
    query, key, value, ids = inputs(layout)
    options = dict(causal=causal, document_ids=ids)
    tested = SINGLE_PROCESS[name](query, key, value, **options)
    assert_like_reference(tested, query, key, value, **options)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiled_documents_and_lse_for_any_block_in_float64(block, layout):
    query, key, value, ids = inputs(layout, dtype=torch.float64)
    out, lse = tiled_attention(
        query, key, value, document_ids=ids, block=block, return_lse=True
    )  # fmt: skip
    golden, golden_lse = reference(query, key, value, document_ids=ids, return_lse=True)
    assert (out - golden).abs().max() < 1e-12
    assert lse.dtype == torch.float64 and (lse - golden_lse).abs().max() < 1e-12


@pytest.mark.parametrize("name", SINGLE_PROCESS)
@pytest.mark.parametrize(
    "options",
    [
        dict(window=9),
        dict(key_lengths=torch.tensor([100, 61])),
        dict(key_starts=torch.tensor([0, 30])),
        dict(key_starts=torch.tensor([12, 40]), key_lengths=torch.tensor([100, 90])),
        dict(mask=torch.rand(2, 1, 100, 100) > 0.3),
        dict(mask=torch.randn(100, 100)),
    ],
    ids=["window", "key_lengths", "key_starts", "both bounds", "bool mask", "float mask"],
)
def test_documents_combine_with_every_other_rule(name, options):
    query, key, value, ids = inputs("crossing")
    options = dict(options, document_ids=ids)
    tested = SINGLE_PROCESS[name](query, key, value, **options)
    golden = reference(query, key, value, **options)
    assert_judged(tested, naive_attention(query, key, value, **options), golden)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
@pytest.mark.parametrize("starts", [[0, 0], [5, 64], [64, 99], [100, 3]])
@pytest.mark.parametrize("q_len", [100, 20])
def test_left_padding_matches_reference(name, starts, q_len):
    """Keys before ``key_starts[b]`` are hidden from every row; a start of k_len hides all."""
    query, key, value = make_qkv(q_len=q_len, k_len=100)
    options = dict(key_starts=torch.tensor(starts))
    tested = SINGLE_PROCESS[name](query, key, value, **options)
    golden = reference(query, key, value, **options)
    assert_judged(tested, naive_attention(query, key, value, **options), golden)


def gradients(function, inputs, grad_out, **options):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    function(*inputs, **options).backward(grad_out.to(inputs[0].dtype))
    return [x.grad for x in inputs]


@pytest.mark.parametrize("block", BLOCKS[1:], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiled_gradients_with_documents(block, layout):
    query, key, value, ids = inputs(layout)
    options = dict(document_ids=ids, key_starts=torch.tensor([3, 0]))
    grad_out = torch.randn(query.shape, dtype=torch.float64)
    tested = gradients(tiled(block), (query, key, value), grad_out, **options)
    base = gradients(naive_attention, (query, key, value), grad_out, **options)
    golden = gradients(reference, [x.double() for x in (query, key, value)], grad_out, **options)
    for t, b, g in zip(tested, base, golden, strict=True):
        assert_judged(t, b, g, factor=3.0)


def test_rows_whose_document_is_padded_away_are_zero_with_zero_gradient():
    """Row 0's document is all left padding: it sees nothing, so zeros and no gradient."""
    query, key, value, ids = inputs("crossing")
    query.requires_grad_()
    options = dict(document_ids=ids, key_starts=torch.tensor([13, 0]), block=(8, 8))
    out = tiled_attention(query, key, value, **options)
    assert not out[0, :, :13].any()
    out.sum().backward()
    assert not query.grad[0, :, :13].any() and query.grad[0, :, 13:].abs().sum() > 0


def count_visits(monkeypatch):
    """Record every (rows, columns) block pair the forward computes, and whether the walk
    masks it by document."""
    from octlm.attention.tiled.walk import BlockWalk

    visited = []
    original = BlockWalk.scores

    def counting(self, q_block, rows, columns, transposed=False):
        visited.append((rows.start, columns.start, (rows.start, columns.start) in self._mixed))
        return original(self, q_block, rows, columns, transposed)

    monkeypatch.setattr(BlockWalk, "scores", counting)
    return visited


def visible_pairs(visible: Tensor, block_q: int, block_k: int) -> set[tuple[int, int]]:
    """Block pairs (row start, key start) of a dense (Q, K) visibility, lengths multiples of
    the block, in which some row sees some key."""
    q_len, k_len = visible.shape
    grid = visible.view(q_len // block_q, block_q, k_len // block_k, block_k).any(3).any(1)
    return {(r * block_q, c * block_k) for r, c in grid.nonzero().tolist()}


def test_eight_documents_visit_an_eighth_of_the_causal_blocks(monkeypatch):
    """8,192 tokens in 8 documents of 1,024, causal: only block pairs inside a document are
    computed (about 1/8 of the causal pairs), and none of them needs the document mask."""
    visited = count_visits(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the grid as given: more threads cut query blocks smaller
    length, block = 8192, (512, 256)
    query, key, value = make_qkv(batch=1, heads=1, kv_heads=1, q_len=length, head_size=2)
    ids = documents([[1024] * 8])
    try:
        out = tiled_attention(query, key, value, block=block, document_ids=ids)
    finally:
        torch.set_num_threads(threads)
    pairs = {(r, c) for r, c, _ in visited}
    position = torch.arange(length)
    causal = position[None, :] <= position[:, None]  # (Q, K)
    assert pairs == visible_pairs(causal & (ids[0][:, None] == ids[0][None, :]), *block)
    assert len(pairs) == len(visited)  # no pair visited twice: no shift moved here
    assert len(pairs) / len(visible_pairs(causal, *block)) < 0.2  # 48 of 272; 1/8 as blocks shrink
    assert not any(mixed for *_, mixed in visited)
    for start in (0, length - 1024):  # the first and last documents are plain causal attention
        part = slice(start, start + 1024)
        golden = reference(query[..., part, :], key[..., part, :], value[..., part, :])
        assert (out[..., part, :] - golden).abs().max() < 1e-5


@pytest.mark.parametrize("starts", [[300, 300], [300, 520], [0, 700]])
def test_left_padding_skips_leading_blocks(monkeypatch, starts):
    """Key blocks before the earliest start are never computed."""
    visited = count_visits(monkeypatch)
    query, key, value = make_qkv(q_len=1024, head_size=2)
    tiled_attention(query, key, value, block=(128, 128), key_starts=torch.tensor(starts))
    earliest = min(starts)
    expected = {(r, c) for r in range(0, 1024, 128) for c in range(earliest, r + 128, 128)}
    assert {(r, c) for r, c, _ in visited} == expected


def test_unsorted_document_ids_are_exact():
    """Ids need not be sorted or contiguous: interleaved documents are masked element-wise."""
    query, key, value = make_qkv(q_len=96, dtype=torch.float64)
    ids = torch.randint(0, 3, (2, 96))
    tested = tiled_attention(query, key, value, document_ids=ids, block=(16, 16))
    golden = reference(query, key, value, document_ids=ids)
    assert (tested - golden).abs().max() < 1e-12


def test_the_picture_in_the_design_doc():
    """docs/design.md, 'Tensor conventions' draws this packed row; naive must see exactly what it
    draws."""
    picture = """
        . . . . . . . .
        . # . . . . . .
        . # # . . . . .
        . . . # . . . .
        . . . # # . . .
        . . . . . # . .
        . . . . . # # .
        . . . . . # # #
    """
    drawn = torch.tensor([[c == "#" for c in line.split()] for line in picture.split("\n")[1:-1]])
    zeros = torch.zeros(1, 1, 8, 8)
    value = torch.eye(8).view(1, 1, 8, 8)  # each key's value marks it: out = its weight
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    weights = naive_attention(zeros, zeros, value, document_ids=ids, key_starts=torch.tensor([1]))
    assert torch.equal(weights[0, 0] > 0, drawn)


@pytest.mark.parametrize("name", SINGLE_PROCESS)
@pytest.mark.parametrize("q_len, window", [(1, 0), (1, 5), (4, 0), (4, 7)])
def test_left_padded_decoding_equals_each_row_alone(name, q_len, window):
    """Ragged prompts, left-padded so each row's newest token is the last key: the
    bottom-right causal and window rules then hold per row, and each row's attention equals
    attention over its own keys alone."""
    lengths = [9, 23, 16]
    query, key, value = make_qkv(batch=3, q_len=q_len, k_len=23)
    starts = torch.tensor([23 - n for n in lengths])
    options = dict(key_starts=starts, window=window)
    batched = SINGLE_PROCESS[name](query, key, value, **options)
    alone = torch.cat([
        reference(query[row : row + 1], key[row : row + 1, :, start:],
                  value[row : row + 1, :, start:], window=window)
        for row, start in enumerate(starts.tolist())
    ])  # fmt: skip
    assert_judged(batched, naive_attention(query, key, value, **options), alone)


@pytest.mark.parametrize("name", ["naive", "tiled"])
@pytest.mark.parametrize("block", [(16, 8), (64, 64)], ids=str)
def test_nan_stays_inside_its_document(name, block):
    """docs/design.md, 'Tensor conventions': a NaN in a key or value of one document reaches exactly
    the rows of that document that see it, never another document's rows."""
    query, key, value, ids = inputs("crossing")
    key[0, 0, 20, 3] = float("nan")  # document 1 of row 0 (keys 13..52)
    value[1, 1, 60, 0] = float("nan")  # document 1 of row 1 (keys 50..99)
    function = tiled(block) if name == "tiled" else naive_attention
    out = function(query, key, value, document_ids=ids)
    position = torch.arange(100)
    broken = torch.zeros(2, 4, 100, dtype=torch.bool)
    broken[0, :2] = (ids[0] == 1) & (position >= 20)  # kv head 0 serves query heads 0, 1
    broken[1, 2:] = (ids[1] == 1) & (position >= 60)  # kv head 1 serves query heads 2, 3
    assert torch.equal(out.isnan().any(dim=-1), broken)
