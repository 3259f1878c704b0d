"""Block masks: any attention pattern, given as a predicate, evaluated once per block.

``block_mask(mask_mod, batch, heads, q_len, k_len, block=...)`` calls the vectorised predicate
``mask_mod(b, h, q_index, k_index) -> bool`` (index tensors that broadcast against each other,
as FlexAttention's) one query block at a time and keeps, per (query block, key block) pair,
whether it is empty, full or partial, and the element masks of the partial ones. The result is
reusable across layers and steps: ``tiled_attention(block_mask=...)`` skips the empty blocks
and runs the full ones without mask arithmetic; ``naive`` and ``sdpa`` take its dense
equivalent. The constructors below give the common patterns as ``mask_mod`` functions.

Query ``q_index`` and key ``k_index`` are plain positions (``0..q_len-1``, ``0..k_len-1``); a
``mask_mod`` that wants the bottom-right alignment of docs/design.md §2 adds ``k_len - q_len``
itself. The result of ``mask_mod`` may broadcast over batch or heads (size 1), and the map
keeps that size, so a pattern shared by all heads costs one head's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class BlockMask:
    """A ``mask_mod`` evaluated per block. ``state (batch, heads, nq, nk)`` holds EMPTY,
    PARTIAL or FULL per block pair; ``pieces`` maps each
    block pair that is neither empty nor full everywhere to its bool element mask
    ``(b, h, R, C)``."""

    mask_mod: MaskMod
    batch: int
    heads: int
    q_len: int
    k_len: int
    block: tuple[int, int]
    state: Tensor
    pieces: dict[tuple[int, int], Tensor] = field(repr=False)

    def visits(self, q_block: int, k_block: int) -> bool:
        """Whether some batch element or head sees some key of this block pair."""
        return bool((self.state[:, :, q_block, k_block] != EMPTY).any())

    def piece(self, q_block: int, k_block: int) -> Tensor | None:
        """The element mask ``(b, h, R, C)`` of one block pair; ``None`` when it is full."""
        return self.pieces.get((q_block, k_block))

    def dense(self, device=None) -> Tensor:
        """The whole mask, bool ``(b, h, q_len, k_len)``, for implementations that need one."""
        return _evaluate(self.mask_mod, self.batch, self.heads, range(self.q_len),
                         range(self.k_len), device)  # fmt: skip


def block_mask(
    mask_mod: MaskMod,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    block: int | tuple[int, int] = (512, 256),
    device=None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once into a :class:`BlockMask` with tiles of ``block``.

    One query block of rows at a time, so memory stays at ``block_q x k_len`` per batch
    element and head that the predicate depends on; the time is one elementwise pass over
    ``q_len x k_len`` places (far less than attention's ``head_size`` multiply-adds per place).
    """
    from octlm.attention.blocks import parse_block

    block_q, block_k = parse_block(block)
    for name, number in (("batch", batch), ("heads", heads), ("q_len", q_len), ("k_len", k_len)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"{name} must be an int >= 0, got {number!r}")
    n_q, n_k = -(-q_len // block_q), -(-k_len // block_k)
    state = torch.full((batch, heads, n_q, n_k), EMPTY, dtype=torch.int8, device=device)
    pieces = {}
    for q_block in range(n_q):
        rows = range(q_block * block_q, min((q_block + 1) * block_q, q_len))
        visible = _evaluate(mask_mod, batch, heads, rows, range(k_len), device)  # (b, h, R, K)
        # Whole key blocks at once: pad the last one with a copy of its last key, which
        # changes neither "all" nor "any".
        filler = visible[..., -1:].expand(*visible.shape[:-1], n_k * block_k - k_len)
        grid = torch.cat([visible, filler], dim=-1).unflatten(-1, (n_k, block_k))
        seen_all = grid.all(dim=-1).all(dim=-2)  # (b, h, nk)
        seen_any = grid.any(dim=-1).any(dim=-2)  # (b, h, nk)
        here = torch.where(seen_all, FULL, torch.where(seen_any, PARTIAL, EMPTY))
        state[:, :, q_block] = here  # broadcast over batch and heads
        mixed = ~((here == EMPTY).flatten(0, 1).all(0) | (here == FULL).flatten(0, 1).all(0))
        for k_block in mixed.nonzero().flatten().tolist():
            part = visible[..., k_block * block_k : (k_block + 1) * block_k]  # (b, h, R, C)
            pieces[(q_block, k_block)] = part.contiguous()
    return BlockMask(
        mask_mod, batch, heads, q_len, k_len, (block_q, block_k), state, pieces
    )  # fmt: skip


def _evaluate(mask_mod, batch, heads, rows: range, columns: range, device) -> Tensor:
    """``mask_mod`` on broadcastable index tensors, as bool ``(b, h, R, C)``."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1)
    k = torch.arange(columns.start, columns.stop, device=device).view(1, 1, 1, -1)
    visible = mask_mod(b, h, q, k)
    if not isinstance(visible, Tensor) or visible.dtype != torch.bool or visible.dim() > 4:
        raise TypeError(f"mask_mod must return a bool tensor of at most 4 dims, got {visible!r}")
    visible = visible.view((1,) * (4 - visible.dim()) + tuple(visible.shape))
    return visible.expand(torch.broadcast_shapes(visible.shape, (1, 1, len(rows), len(columns))))


# Named patterns, as mask_mod functions.


def causal_mod(q_len: int, k_len: int) -> MaskMod:
    """Bottom-right causal: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``."""
    past = k_len - q_len
    return lambda b, h, q, k: k <= q + past


def sliding_window_mod(q_len: int, k_len: int, window: int) -> MaskMod:
    """Causal, and only the ``window`` most recent keys (the row's own included)."""
    past = k_len - q_len
    return lambda b, h, q, k: (k <= q + past) & (q + past - k < window)


def document_mod(document_ids: Tensor, q_len: int, causal: bool = True) -> MaskMod:
    """Packed documents ``(batch, k_len)``: a row sees keys of its own document only."""
    past = document_ids.shape[1] - q_len

    def mod(b, h, q, k):
        same = document_ids[b, q + past] == document_ids[b, k]
        return same & (k <= q + past) if causal else same

    return mod


def prefix_lm_mod(prefix_lengths: Tensor) -> MaskMod:
    """Prefix-LM (``q_len == k_len``): keys before ``prefix_lengths[b]`` are seen by every row
    (a bidirectional prefix); after it, causal."""
    return lambda b, h, q, k: (k <= q) | (k < prefix_lengths[b])


def chunked_mod(chunk: int) -> MaskMod:
    """Chunked local attention (``q_len == k_len``): causal within chunks of ``chunk`` tokens."""
    return lambda b, h, q, k: (k <= q) & (q // chunk == k // chunk)
