"""Tiles of tiled attention: how a block size is given and checked, its default, the kernels.

Imports nothing of octlm, so that block masks, which share the tiles, can sit below tiled.
"""

from __future__ import annotations

# Query rows and keys per tile: smaller tiles pay Python overhead per block, larger ones fall
# out of cache (docs/benchmarks.md, block sizes).
DEFAULT_BLOCK = (512, 256)
# ``tiled_attention(kernel=...)``: the Triton kernel on CUDA where it fits, or one forced.
KERNELS = ("auto", "pytorch", "triton")


def parse_block(block: int | tuple[int, int]) -> tuple[int, int]:
    """``block`` as ``(block_q, block_k)``; an int sets both."""
    pair = (block, block) if isinstance(block, int) and not isinstance(block, bool) else block
    if (
        not isinstance(pair, tuple | list)
        or len(pair) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in pair)
    ):
        raise ValueError(f"block must be an int >= 1 or a pair (block_q, block_k), got {block!r}")
    return int(pair[0]), int(pair[1])
