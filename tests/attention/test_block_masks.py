"""Block masks: a ``mask_mod`` evaluated once per block, accepted by every single-process
implementation, against the independent float64 reference given the same pattern densely.

The reference sees the pattern as a plain bool mask built here from the definitions, never
through octlm; the named patterns are checked against those definitions too.
"""

from __future__ import annotations

import pytest
import torch

from octlm.attention import IMPLEMENTATIONS, block_mask, naive_attention, tiled_attention
from octlm.attention.block_masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Pattern,
    causal_mod,
    chunked_mod,
    document_mod,
    prefix_lm_mod,
    sliding_window_mod,
)
from tests.helpers import assert_judged, make_qkv, reference

LENGTH = 96
POSITION = torch.arange(LENGTH)
IDS = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 1, 40, 25])).expand(2, -1)
PREFIX = torch.tensor([20, 50])

# name: (mask_mod, the same pattern written out, bool broadcastable to (B, H, Q, K))
PATTERNS = {
    "causal": (causal_mod(LENGTH, LENGTH), POSITION[None, :] <= POSITION[:, None]),
    "window": (
        sliding_window_mod(LENGTH, LENGTH, 17),
        (POSITION[None, :] <= POSITION[:, None]) & (POSITION[:, None] - POSITION[None, :] < 17),
    ),
    "documents": (
        document_mod(IDS, LENGTH),
        ((IDS[:, :, None] == IDS[:, None, :]) & (POSITION[None, :] <= POSITION[:, None]))[:, None],
    ),
    "prefix-lm": (
        prefix_lm_mod(PREFIX),
        ((POSITION[None, :] <= POSITION[:, None]) | (PREFIX[:, None, None] > POSITION))[:, None],
    ),
    "chunked": (
        chunked_mod(24),
        (POSITION[None, :] <= POSITION[:, None]) & (POSITION[:, None] // 24 == POSITION // 24),
    ),
    "per head": (
        lambda b, h, q, k: (k <= q) & ((k + h) % 3 != 0),
        (POSITION[None, :] <= POSITION[:, None])
        & ((POSITION + torch.arange(4)[:, None, None]) % 3 != 0),
    ),
}


def expected(name):
    pattern = PATTERNS[name][1]
    return pattern.view((1,) * (4 - pattern.dim()) + tuple(pattern.shape))


SINGLE_PROCESS = {
    name: impl.function for name, impl in IMPLEMENTATIONS.items() if "block_mask" in impl.features
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("block", [(16, 16), (32, 24), 7, (512, 256)], ids=str)
def test_block_states_and_pieces_match_the_pattern(name, block):
    mask = block_mask(PATTERNS[name][0], 2, 4, LENGTH, LENGTH, block=block)
    dense = expected(name).expand(2, 4, LENGTH, LENGTH)
    assert torch.equal(mask.dense().expand(dense.shape), dense)
    block_q, block_k = mask.block
    for q_block in range(mask.state.shape[2]):
        for k_block in range(mask.state.shape[3]):
            part = dense[:, :, q_block * block_q :, k_block * block_k :]
            part = part[:, :, :block_q, :block_k].flatten(2)
            state = mask.state[:, :, q_block, k_block]
            assert torch.equal(state == FULL, part.all(-1))
            assert torch.equal(state == EMPTY, ~part.any(-1))
            assert torch.equal(state == PARTIAL, part.any(-1) & ~part.all(-1))


@pytest.mark.parametrize("implementation", SINGLE_PROCESS)
@pytest.mark.parametrize("name", PATTERNS)
def test_block_mask_matches_reference(implementation, name):
    query, key, value = make_qkv(heads=4, q_len=LENGTH)
    mask = block_mask(PATTERNS[name][0], 2, 4, LENGTH, LENGTH, block=(16, 32))
    tested = SINGLE_PROCESS[implementation](query, key, value, causal=False, block_mask=mask)
    golden = reference(query, key, value, causal=False, mask=expected(name))
    assert_judged(tested, naive_attention(query, key, value, causal=False, mask=expected(name)),
                  golden)  # fmt: skip


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("block", [(16, 16), (32, 24), 7], ids=str)
def test_tiled_block_mask_forward_and_gradients_in_float64(name, block):
    query, key, value = make_qkv(heads=4, q_len=LENGTH, dtype=torch.float64, requires_grad=True)
    mask = block_mask(PATTERNS[name][0], 2, 4, LENGTH, LENGTH, block=block)
    out = tiled_attention(query, key, value, block_mask=mask, window=40)  # ANDed with causal
    golden = reference(query, key, value, window=40, mask=expected(name))
    assert (out - golden).abs().max() < 1e-12
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    tested = torch.autograd.grad(out, (query, key, value), grad_out)
    wanted = torch.autograd.grad(golden, (query, key, value), grad_out)
    for t, w in zip(tested, wanted, strict=True):
        assert (t - w).abs().max() < 1e-10


def test_empty_blocks_are_skipped_and_full_ones_unmasked(monkeypatch):
    from octlm.attention.tiled.walk import BlockWalk

    visited = []
    original = BlockWalk.scores

    def counting(self, q_block, rows, columns, transposed=False):
        visited.append((rows.start // 16, columns.start // 16))
        return original(self, q_block, rows, columns, transposed)

    monkeypatch.setattr(BlockWalk, "scores", counting)
    query, key, value = make_qkv(heads=4, q_len=LENGTH)
    mask = block_mask(chunked_mod(32), 2, 4, LENGTH, LENGTH, block=16)
    tiled_attention(query, key, value, causal=False, block_mask=mask)
    # Chunks of 32 are two blocks of 16: each query block sees its own chunk's blocks only.
    assert set(visited) == {
        (q, k) for q in range(6) for k in range(6) if k // 2 == q // 2 and k <= q
    }
    assert set(mask.pieces) == {(q, q) for q in range(6)}  # only the diagonal is partial


# Named patterns whose block rules are checked against evaluating every place: the ones above,
# unsorted document ids, and fewer queries than keys.
SHUFFLED = torch.stack([torch.randperm(5, generator=torch.Generator().manual_seed(s))
                        for s in (0, 1)])[:, torch.arange(LENGTH) * 5 // LENGTH]  # fmt: skip
CLASSIFIED = {
    **{name: (pattern, LENGTH) for name, (pattern, _) in PATTERNS.items() if name != "per head"},
    "documents unsorted, not causal": (document_mod(SHUFFLED, LENGTH, causal=False), LENGTH),
    "documents, 40 queries": (document_mod(IDS, 40), 40),
    "causal, 40 queries": (causal_mod(40, LENGTH), 40),
    "window, 40 queries": (sliding_window_mod(40, LENGTH, 9), 40),
}


@pytest.mark.parametrize("name", CLASSIFIED)
@pytest.mark.parametrize("block", [(16, 16), (32, 24), 7, (64, 5), (512, 256)], ids=str)
def test_block_rules_give_the_map_of_evaluating_every_place(name, block):
    """A named pattern classifies whole blocks from their bounds and evaluates only the rest;
    the same predicate as a plain function is evaluated everywhere. The maps must be equal."""
    pattern, q_len = CLASSIFIED[name]
    fast = block_mask(pattern, 2, 4, q_len, LENGTH, block=block)
    everywhere = block_mask(lambda *index: pattern(*index), 2, 4, q_len, LENGTH, block=block)
    assert torch.equal(fast.state, everywhere.state)
    assert fast.pieces.keys() == everywhere.pieces.keys()
    for pair, piece in everywhere.pieces.items():
        assert torch.equal(fast.pieces[pair], piece), pair


def test_named_patterns_evaluate_only_the_blocks_an_edge_crosses():
    """Causal at 256 tokens in blocks of 32: only the 8 diagonal blocks are looked at place by
    place; every other block is settled from its bounds."""
    pattern = causal_mod(256, 256)
    evaluated = []

    def counting(b, h, q, k):
        evaluated.append(q.numel() * k.numel())
        return pattern(b, h, q, k)

    mask = block_mask(Pattern(counting, pattern.classify), 1, 2, 256, 256, block=32)
    assert sum(evaluated) == 8 * 32 * 32
    assert set(mask.pieces) == {(q, q) for q in range(8)}
