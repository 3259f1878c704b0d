"""BlockMask.counts and BlockMask.plot describe the map tiled walks, checked against the dense
mask it stands for."""

import pytest
import torch

from octlm.attention import block_mask
from octlm.attention.block_masks import causal_mod, document_mod, sliding_window_mod

LENGTH = 96
DOCUMENTS = torch.tensor([[0] * 30 + [1] * 5 + [2] * 61])  # (1, 96)
PATTERNS = {
    "causal": causal_mod(LENGTH, LENGTH),
    "window": sliding_window_mod(LENGTH, LENGTH, 20),
    "documents": document_mod(DOCUMENTS, LENGTH),
}


def dense_counts(dense: torch.Tensor, block: tuple[int, int]) -> dict[str, int]:
    """Classify each tile of a dense (Q, K) bool mask by looking at every place in it."""
    counts = {"skipped": 0, "masked": 0, "unmasked": 0}
    for row in range(0, dense.shape[0], block[0]):
        for column in range(0, dense.shape[1], block[1]):
            tile = dense[row : row + block[0], column : column + block[1]]
            key = "unmasked" if tile.all() else "skipped" if not tile.any() else "masked"
            counts[key] += 1
    return counts


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("block", [(16, 16), (32, 8), (25, 40)])
def test_counts_match_the_dense_mask_tile_by_tile(name, block):
    mask = block_mask(PATTERNS[name], 1, 2, LENGTH, LENGTH, block=block)
    assert mask.counts(0, 1) == dense_counts(mask.dense()[0, 0], block)


def test_plot_draws_one_square_per_block_pair_and_names_the_counts():
    mask = block_mask(PATTERNS["documents"], 1, 1, LENGTH, LENGTH, block=(16, 32))
    figure = mask.plot(title="documents")
    (axes,) = figure.axes
    (image,) = axes.get_images()
    assert image.get_array().shape == (6, 3)  # ceil(96 / 16) query blocks, 96 / 32 key blocks
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    counts = mask.counts()
    assert labels == [f"{name} ({count})" for name, count in counts.items()]
    assert sum(counts.values()) == 18


@pytest.mark.parametrize("batch, head", [(1, 0), (0, 2), (-1, 0), (True, 0)])
def test_plot_refuses_a_batch_or_head_outside_the_map(batch, head):
    mask = block_mask(PATTERNS["causal"], 1, 2, LENGTH, LENGTH, block=16)
    with pytest.raises(ValueError, match=r"batch|head"):
        mask.plot(batch, head)
