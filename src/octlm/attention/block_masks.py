"""Block masks: any attention pattern, given as a predicate, evaluated once per block.

``block_mask(mask_mod, batch, heads, q_len, k_len, block=...)`` keeps, per (query block, key
block) pair, whether the vectorised predicate ``mask_mod(b, h, q_index, k_index) -> bool``
(index tensors that broadcast against each other, as FlexAttention's) is empty, full or partial
there, and the element masks of the pairs that are partial. The result is reusable across
layers and steps: ``tiled_attention(block_mask=...)`` skips the empty blocks and runs the full
ones without mask arithmetic; ``naive`` and ``sdpa`` take its dense equivalent.

The named patterns below (:func:`causal_mod`, :func:`sliding_window_mod`, :func:`document_mod`,
:func:`prefix_lm_mod`, :func:`chunked_mod`) are :class:`Pattern` s: beside the predicate they
carry a rule that tells, from each block's first and last index alone (and each block's
smallest and largest document id), which blocks are surely full and which surely empty. Only
the other blocks (in practice those a pattern's edge crosses) are evaluated element by element,
so building the map costs O(blocks + edge places) instead of O(q_len x k_len). Any other
callable is evaluated everywhere, one query block at a time. Both give the same map.

Query ``q_index`` and key ``k_index`` are plain positions (``0..q_len-1``, ``0..k_len-1``); a
``mask_mod`` that wants the bottom-right alignment of docs/design.md, 'Tensor conventions' adds
``k_len - q_len`` itself. The result of ``mask_mod`` may broadcast over batch or heads (size 1), and
the map keeps that size, so a pattern shared by all heads costs one head's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from octlm.attention.tiled.options import DEFAULT_BLOCK, parse_block

EMPTY, PARTIAL, FULL = 0, 1, 2
STATES = {"skipped": EMPTY, "masked": PARTIAL, "unmasked": FULL}  # what tiled does per pair
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Spans:
    """One side's blocks: block ``n`` covers indices ``first[n]`` to ``last[n]`` (inclusive)."""

    first: Tensor  # (n,)
    last: Tensor  # (n,)
    size: int  # indices per block (the last block may hold fewer)

    @staticmethod
    def of(length: int, size: int, device=None) -> Spans:
        first = torch.arange(0, length, size, device=device)  # (n,)
        return Spans(first, (first + size).clamp_(max=length) - 1, size)

    def extremes(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The smallest and largest of ``values (B, length)`` in each block, ``(B, n)`` each."""
        count = len(self.first)
        filler = values[:, -1:].expand(-1, count * self.size - values.shape[1])  # repeats one
        blocks = torch.cat([values, filler], dim=1).view(values.shape[0], count, self.size)
        return blocks.amin(dim=2), blocks.amax(dim=2)


# From the query blocks' and key blocks' spans, (surely full, surely empty), each bool and
# broadcastable to (batch, heads, n_q, n_k). "Surely" is the contract: a block marked full
# must be visible at every place, one marked empty at none; unmarked blocks are evaluated.
Classifier = Callable[[Spans, Spans], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Pattern:
    """A ``mask_mod`` that also classifies whole blocks from their spans (see
    :data:`Classifier`); called, it is the ``mask_mod``."""

    mask_mod: MaskMod
    classify: Classifier

    def __call__(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return self.mask_mod(b, h, q, k)


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
    # visited[q_block][k_block]: the state's "not empty somewhere", read once per block pair
    # by the walk, so kept as Python bools rather than asked of the tensor each time.
    visited: list[list[bool]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        seen = (self.state != EMPTY).flatten(0, 1).any(dim=0)  # (nq, nk)
        object.__setattr__(self, "visited", seen.tolist())

    def visits(self, q_block: int, k_block: int) -> bool:
        """Whether some batch element or head sees some key of this block pair."""
        return self.visited[q_block][k_block]

    def piece(self, q_block: int, k_block: int) -> Tensor | None:
        """The element mask ``(b, h, R, C)`` of one block pair; ``None`` when it is full."""
        return self.pieces.get((q_block, k_block))

    def dense(self, device=None) -> Tensor:
        """The whole mask, bool ``(b, h, q_len, k_len)``, for implementations that need one."""
        return _evaluate(
            self.mask_mod, self.batch, self.heads, range(self.q_len), range(self.k_len), device
        )

    def counts(self, batch: int = 0, head: int = 0) -> dict[str, int]:
        """How many block pairs of one batch element and head are empty (skipped), partial
        (computed with a mask) and full (computed with none)."""
        state = self._map(batch, head)  # (nq, nk)
        return {name: int((state == code).sum()) for name, code in STATES.items()}

    def _map(self, batch: int, head: int) -> Tensor:
        """The ``(nq, nk)`` states of one batch element and head (the map may broadcast)."""
        for name, index, size in (("batch", batch, self.batch), ("head", head, self.heads)):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
                raise ValueError(f"{name} must be an int in [0, {size}), got {index!r}")
        return self.state[min(batch, self.state.shape[0] - 1), min(head, self.state.shape[1] - 1)]

    def plot(self, batch: int = 0, head: int = 0, title: str | None = None):
        """A matplotlib ``Figure`` of the map of one batch element and head: a square per
        (query block, key block) pair, white where the pair is skipped, light where it is
        computed with a mask, dark where it is computed with none. Needs matplotlib."""
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        state = self._map(batch, head)  # (nq, nk)
        colours = ("#ffffff", "#9ecae1", "#08519c")  # EMPTY, PARTIAL, FULL
        figure = Figure(figsize=(4.2, 4.6), layout="constrained")
        axes = figure.subplots()
        # Each square drawn block_q tall and block_k wide, so the picture is to scale in tokens.
        axes.imshow(
            state.cpu().numpy(),
            cmap=ListedColormap(colours),
            vmin=0,
            vmax=2,
            interpolation="nearest",
            aspect=self.block[0] / self.block[1],
        )
        rows, columns = state.shape
        axes.set_xticks([x - 0.5 for x in range(columns + 1)], minor=True)
        axes.set_yticks([y - 0.5 for y in range(rows + 1)], minor=True)
        axes.grid(which="minor", color="#bbbbbb", linewidth=0.5)
        axes.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
        axes.set_xlabel(f"key blocks of {self.block[1]}")
        axes.set_ylabel(f"query blocks of {self.block[0]}")
        counts = self.counts(batch, head)
        legend = [
            Patch(facecolor=colour, edgecolor="#888888", label=f"{name} ({counts[name]})")
            for name, colour in zip(STATES, colours, strict=True)
        ]
        axes.legend(
            handles=legend,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.08),
            ncol=3,
            frameon=False,
            fontsize="small",
        )
        axes.set_title(title or f"{self.q_len} queries x {self.k_len} keys", fontsize="medium")
        return figure


def block_mask(
    mask_mod: MaskMod,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    device=None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once into a :class:`BlockMask` with tiles of ``block``.

    A :class:`Pattern` (every named constructor here) first classifies whole blocks from their
    spans; what is left, and every block of any other ``mask_mod``, is evaluated element by
    element, one query block at a time over the key blocks that need it, so memory stays at
    ``block_q x k_len`` per batch element and head that the predicate depends on.
    """
    block_q, block_k = parse_block(block)
    for name, number in (("batch", batch), ("heads", heads), ("q_len", q_len), ("k_len", k_len)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(f"{name} must be an int >= 0, got {number!r}")
    rows, columns = Spans.of(q_len, block_q, device), Spans.of(k_len, block_k, device)
    state = torch.full(
        (batch, heads, len(rows.first), len(columns.first)),
        PARTIAL,
        dtype=torch.int8,
        device=device,
    )
    if isinstance(mask_mod, Pattern) and state.numel():
        full, empty = mask_mod.classify(rows, columns)
        state[:] = torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL))
    # Pairs that are not one state in every batch element and head: not yet known, or known
    # but mixed (their element mask is needed either way).
    settled = _same_everywhere(state, EMPTY) | _same_everywhere(state, FULL)  # (nq, nk)
    pieces = {}
    for q_block, unsettled in enumerate(~settled):
        looked = unsettled.nonzero().flatten().tolist()
        if not looked:
            continue
        first, last = looked[0], looked[-1]  # evaluate the keys of blocks first..last at once
        keys = range(first * block_k, min((last + 1) * block_k, k_len))
        queries = range(q_block * block_q, min((q_block + 1) * block_q, q_len))
        visible = _evaluate(mask_mod, batch, heads, queries, keys, device)  # (b, h, R, K')
        seen_all, seen_any = _per_key_block(visible, block_k)  # (b, h, n') each
        here = torch.where(seen_all, FULL, torch.where(seen_any, PARTIAL, EMPTY))
        state[:, :, q_block, first : last + 1] = here  # broadcast over batch and heads
        mixed = ~(_same_everywhere(here, EMPTY) | _same_everywhere(here, FULL))  # (n',)
        for index in mixed.nonzero().flatten().tolist():
            part = visible[..., index * block_k : (index + 1) * block_k]  # (b, h, R, C)
            pieces[(q_block, first + index)] = part.contiguous()
    return BlockMask(mask_mod, batch, heads, q_len, k_len, (block_q, block_k), state, pieces)


def _same_everywhere(state: Tensor, value: int) -> Tensor:
    """Whether ``state (b, h, ...)`` is ``value`` in every batch element and head, ``(...)``."""
    return (state == value).flatten(0, 1).all(dim=0)


def _per_key_block(visible: Tensor, block_k: int) -> tuple[Tensor, Tensor]:
    """Whether every place / some place of each key block of ``visible (b, h, R, K')`` is
    visible, ``(b, h, n')`` each; the last block may be short."""
    # Rows first: a reduction across rows runs along contiguous keys, several times faster
    # than all()/any() over each block's places.
    by_every_row, by_some_row = visible.amin(dim=-2), visible.amax(dim=-2)  # (b, h, K') each
    count = -(-visible.shape[-1] // block_k)
    filler = count * block_k - visible.shape[-1]  # the last key repeated: changes neither
    every, some = (
        torch.cat([x, x[..., -1:].expand(*x.shape[:-1], filler)], dim=-1).unflatten(-1, (count, -1))
        for x in (by_every_row, by_some_row)
    )  # (b, h, n', C) each
    return every.amin(dim=-1), some.amax(dim=-1)


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


# Named patterns. Each block rule is exact at the level of whole blocks from index bounds:
# ``q.first``/``q.last`` are a query block's first and last row, ``k.first``/``k.last`` a key
# block's; results are (n_q, n_k), or (B, 1, n_q, n_k) where the pattern depends on the batch.


def causal_mod(q_len: int, k_len: int) -> Pattern:
    """Bottom-right causal: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``."""
    past = k_len - q_len
    return Pattern(lambda b, h, q, k: k <= q + past, lambda q, k: _causal_blocks(q, k, past))


def _causal_blocks(q: Spans, k: Spans, past: int) -> tuple[Tensor, Tensor]:
    full = k.last[None, :] <= q.first[:, None] + past  # even the first row sees the last key
    empty = k.first[None, :] > q.last[:, None] + past  # even the last row misses the first key
    return full, empty


def sliding_window_mod(q_len: int, k_len: int, window: int) -> Pattern:
    """Causal, and only the ``window`` most recent keys (the row's own included)."""
    past = k_len - q_len

    def blocks(q: Spans, k: Spans) -> tuple[Tensor, Tensor]:
        full, empty = _causal_blocks(q, k, past)
        full = full & (q.last[:, None] + past - k.first[None, :] < window)
        empty = empty | (q.first[:, None] + past - k.last[None, :] >= window)
        return full, empty

    return Pattern(lambda b, h, q, k: (k <= q + past) & (q + past - k < window), blocks)


def document_mod(document_ids: Tensor, q_len: int, causal: bool = True) -> Pattern:
    """Packed documents ``(batch, k_len)``: a row sees keys of its own document only."""
    past = document_ids.shape[1] - q_len

    def mod(b, h, q, k):
        same = document_ids[b, q + past] == document_ids[b, k]
        return same & (k <= q + past) if causal else same

    def blocks(q: Spans, k: Spans) -> tuple[Tensor, Tensor]:
        q_low, q_high = (x[:, :, None] for x in q.extremes(document_ids[:, past:]))  # (B, nq, 1)
        k_low, k_high = (x[:, None, :] for x in k.extremes(document_ids))  # (B, 1, nk)
        full = ((q_low == q_high) & (k_low == k_high) & (q_low == k_low))[:, None]  # one document
        empty = ((q_high < k_low) | (k_high < q_low))[:, None]  # no id in common
        if causal:
            causal_full, causal_empty = _causal_blocks(q, k, past)
            full, empty = full & causal_full, empty | causal_empty
        return full, empty

    return Pattern(mod, blocks)


def prefix_lm_mod(prefix_lengths: Tensor) -> Pattern:
    """Prefix-LM (``q_len == k_len``): keys before ``prefix_lengths[b]`` are seen by every row
    (a bidirectional prefix); after it, causal."""
    prefix = prefix_lengths.view(-1, 1, 1, 1)  # (B, 1, 1, 1)

    def blocks(q: Spans, k: Spans) -> tuple[Tensor, Tensor]:
        # Key j is seen by every row of the block iff j <= q.first or j < prefix.
        full = k.last[None, :] < torch.maximum(q.first[:, None] + 1, prefix)
        empty = (k.first[None, :] > q.last[:, None]) & (k.first[None, :] >= prefix)
        return full, empty

    return Pattern(lambda b, h, q, k: (k <= q) | (k < prefix_lengths[b]), blocks)


def chunked_mod(chunk: int) -> Pattern:
    """Chunked local attention (``q_len == k_len``): causal within chunks of ``chunk`` tokens."""

    def blocks(q: Spans, k: Spans) -> tuple[Tensor, Tensor]:
        full, empty = _causal_blocks(q, k, 0)
        q_low, q_high = q.first[:, None] // chunk, q.last[:, None] // chunk  # (nq, 1)
        k_low, k_high = k.first[None, :] // chunk, k.last[None, :] // chunk  # (1, nk)
        full = full & (q_low == q_high) & (k_low == k_high) & (q_low == k_low)
        empty = empty | (q_high < k_low) | (k_high < q_low)
        return full, empty

    return Pattern(lambda b, h, q, k: (k <= q) & (q // chunk == k // chunk), blocks)
