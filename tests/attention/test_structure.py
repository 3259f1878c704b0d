"""Structural shortcuts (skipped blocks, whole blocks without mask arithmetic, per-block edge
masks, padding by lengths, the widened decoding tile) equal the dense-mask path.

The dense path hands tiled attention the same rules as one explicit mask with ``causal=False``,
so every block is visited and masked element by element.
"""

from __future__ import annotations

import pytest
import torch

from octlm.attention import naive_attention, tiled_attention
from octlm.attention.masks import allowed
from tests.helpers import assert_judged, make_qkv, reference


def dense(q_len, k_len, causal, window, key_lengths=None):
    visible = allowed(range(q_len), range(k_len), k_len - q_len, causal, window)
    if key_lengths is not None:
        visible = visible & (torch.arange(k_len) < key_lengths[:, None, None, None])
    return visible


@pytest.mark.parametrize(
    "q_len, k_len, window, block",
    [
        (256, 256, 64, (32, 32)),  # window edge on block boundaries
        (250, 250, 50, (32, 48)),  # window edge splitting blocks
        (64, 512, 0, (16, 64)),  # chunked prefill against a longer cache
        (1, 700, 0, (64, 64)),  # decoding: one query, widened key tile
        (3, 700, 100, (64, 64)),  # decoding with a window
        (300, 300, 0, (64, 100)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_structural_path_equals_dense_mask_path(q_len, k_len, window, block, dtype):
    query, key, value = make_qkv(q_len=q_len, k_len=k_len, dtype=dtype)
    structural = tiled_attention(query, key, value, block=block, window=window)
    mask = dense(q_len, k_len, True, window)
    masked = tiled_attention(query, key, value, block=block, causal=False, mask=mask)
    golden = reference(query, key, value, window=window)
    base = naive_attention(query, key, value, window=window)
    assert_judged(structural, base, golden)
    assert_judged(masked, base, golden)
    assert (structural - masked).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-13)


@pytest.mark.parametrize("lengths", [[300, 300], [150, 300], [129, 17], [0, 64]])
def test_padding_by_lengths_equals_dense_mask(lengths):
    key_lengths = torch.tensor(lengths)
    query, key, value = make_qkv(q_len=300, k_len=300)
    by_lengths = tiled_attention(query, key, value, block=(64, 64), key_lengths=key_lengths)
    mask = dense(300, 300, True, 0, key_lengths)
    by_mask = tiled_attention(query, key, value, block=(64, 64), causal=False, mask=mask)
    assert (by_lengths - by_mask).abs().max() <= 1e-6
    golden = reference(query, key, value, key_lengths=key_lengths)
    assert_judged(by_lengths, naive_attention(query, key, value, key_lengths=key_lengths), golden)


def test_padded_and_hidden_blocks_are_never_computed(monkeypatch):
    """Count the key blocks visited: skipping must really happen, not just masking."""
    from octlm.attention.tiled.walk import BlockWalk

    visited = []
    original = BlockWalk.scores

    def counting(self, q_block, rows, columns):
        visited.append((rows, columns))
        return original(self, q_block, rows, columns)

    monkeypatch.setattr(BlockWalk, "scores", counting)
    query, key, value = make_qkv(batch=1, q_len=512, k_len=512)
    tiled_attention(query, key, value, block=(64, 64), window=64)
    # Each 64-row block sees its own keys and the 63 before: at most 2 key blocks.
    assert len(visited) <= 2 * 8 and all(c.stop - c.start <= 64 for _, c in visited)
    visited.clear()
    tiled_attention(
        query, key, value, block=(64, 64), key_lengths=torch.tensor([128]), causal=False
    )
    assert all(c.stop <= 128 for _, c in visited) and len(visited) == 8 * 2
