"""Batches of a split's tokens: random windows of the token stream (:class:`Batches`), which
may straddle documents, or whole documents packed into rows and kept apart by ``document_ids``
(:class:`PackedBatches`, ``octlm train --pack``); and the fixed batches of an evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

IGNORED = -100  # a target that counts for nothing (F.cross_entropy's default ignore_index)


class Batch(NamedTuple):
    """One batch of rows: what the model reads, what it should predict, and its documents."""

    inputs: Tensor  # (B, T) int64
    targets: Tensor  # (B, T) int64, IGNORED where no target counts
    document_ids: Tensor | None = None  # (B, T) int64 for packed rows


def windows(tokens: Tensor, starts: Tensor, length: int, supervised: Tensor | None = None) -> Batch:
    """Inputs and next-token targets ``(B, length)`` int64 at ``starts (B,)``; with
    ``supervised (N,)``, targets it does not mark are ``IGNORED``."""
    offsets = torch.arange(length + 1)  # (length + 1,)
    position = starts.view(-1, 1) + offsets  # (B, length + 1)
    window = tokens[position].long()  # (B, length + 1)
    targets = window[:, 1:]
    if supervised is not None:
        targets = targets.masked_fill(supervised[position[:, 1:]] == 0, IGNORED)
    return Batch(window[:, :-1], targets)


@dataclass
class Batches:
    """Random windows of one split, drawn by a seeded generator whose state is the data position.

    Every rank draws the same global batch; checkpoints save :meth:`state_dict`, so a resumed
    run continues with the very batches the uninterrupted run would have drawn.
    """

    tokens: Tensor  # (N,) unsigned ints
    length: int
    seed: int
    # (N,) uint8: 1 where a token is a target the loss counts (a chat run's); None: all
    supervised: Tensor | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def next(self, batch: int) -> Batch:
        """The next global batch: inputs and targets ``(batch, length)`` int64."""
        starts = torch.randint(
            len(self.tokens) - self.length, (batch,), generator=self.generator
        )  # (batch,)
        return windows(self.tokens, starts, self.length, self.supervised)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


@dataclass
class PackedBatches(Batches):
    """Rows of whole documents, each kept to itself by ``document_ids``.

    A document of more than ``length + 1`` tokens is cut into pieces of ``length`` targets
    (``length + 1`` tokens; each piece's first token is the last of the one before, so no
    target is lost). A row starts at a piece drawn uniformly: a piece that fills the row is
    the row; a document's last piece is followed by the whole documents that fit. What
    remains of the row is padding (the start of the next document, kept to itself), and
    targets that cross into another document or into padding are ``IGNORED``, as are those
    ``supervised`` does not mark.
    """

    starts: Tensor  # (D,) int64: where each document starts in tokens

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ends = torch.cat([self.starts[1:], torch.tensor([len(self.tokens)])])  # (D,)
        targets = (self.ends - self.starts - 1).clamp(min=0)  # (D,)
        pieces = -(-targets // self.length)  # (D,) a one-token document has none
        self.first_piece = pieces.cumsum(0) - pieces  # (D,) index of each document's first
        self.pieces = int(pieces.sum())
        if self.pieces == 0:
            raise ValueError(
                f"packing needs a document of at least 2 tokens; these {len(self.starts)} "
                "documents have 1 each"
            )

    def next(self, batch: int) -> Batch:
        """The next global batch: inputs, targets and document ids ``(batch, length)``."""
        piece = torch.randint(self.pieces, (batch,), generator=self.generator)  # (B,)
        document = torch.searchsorted(self.first_piece, piece, right=True) - 1  # (B,)
        start = self.starts[document] + (piece - self.first_piece[document]) * self.length
        limit = start + self.length + 1  # (B,) one past the row's last token
        fitting = torch.searchsorted(self.ends, limit, right=True).sub(1).clamp(min=0)  # (B,)
        fitting = self.ends[fitting]  # (B,) the last document end within the row
        end = torch.where(self.ends[document] >= limit, limit, fitting)  # (B,) whole documents
        position = start.view(-1, 1) + torch.arange(self.length + 1)  # (B, length + 1)
        window = self.tokens[position.clamp(max=len(self.tokens) - 1)].long()
        ids = torch.searchsorted(self.ends, position, right=True)  # (B, length + 1)
        kept = (ids[:, 1:] == ids[:, :-1]) & (position[:, 1:] < end.view(-1, 1))  # (B, length)
        if self.supervised is not None:
            inside = position[:, 1:].clamp(max=len(self.tokens) - 1)  # (B, length)
            kept &= self.supervised[inside].bool()
        targets = window[:, 1:].masked_fill(~kept, IGNORED)
        return Batch(window[:, :-1], targets, ids[:, :-1])


def evaluation_batches(tokens: Tensor, length: int, batch: int, count: int) -> list[Batch]:
    """``count`` fixed batches whose windows are spread evenly over the whole split."""
    last = len(tokens) - length - 1
    # float64: float32 rounds starts past 2**24 tokens, the last one beyond the split's end
    starts = torch.linspace(0, last, count * batch, dtype=torch.float64).round().long()  # (n,)
    return [windows(tokens, chunk, length) for chunk in starts.split(batch)]
