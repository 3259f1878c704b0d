""":class:`BlockWalk`: which key blocks each query block visits, and one score tile at a time.

Blocks that the causal/window rules, padding, packed documents or a block mask hide entirely are
never touched; blocks the rules show whole get no mask arithmetic at all; only tiles that cross
an edge get their hidden places at ``-inf``. No ``q_len x k_len`` tensor is ever made.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from octlm.attention.masks import allowed, distance, fully_visible, key_range, padding_mask
from octlm.attention.tiled.core import NEG_INF, Rules, Units, as_3d, fold_mask, fold_slopes
from octlm.attention.tiled.threads import workers

# Query blocks per CPU thread, when there are enough rows: blocks are cut smaller to make them,
# down to THREAD_ROWS rows (docs/design.md, 'The numerics of the tiled core', threads).
THREAD_SHARES = 16
THREAD_ROWS = 128


class BlockWalk:
    """Which key blocks each query block visits, and one score tile at a time.

    Works on inputs in the folded layout: ``query (B, Hkv, Q, G, D [+ 1])`` and ``keys (B, Hkv,
    K, D [+ 1])`` may carry one extra column each (see :func:`~octlm.attention.tiled.core.fold`),
    under the call's ``rules``, whose mask and slopes it folds to match. ``past`` places query
    row ``i`` at key position ``past + i``.
    Keys outside ``[key_starts[b], key_lengths[b])`` are padding. With ``documents = (query
    documents (B, Q), key documents (B, K))`` a row sees only keys of its own document: a block
    pair whose document ranges do not meet is skipped, and one that lies inside a single
    document (in every batch element) needs no document mask.
    Score tiles are written into one reused buffer: a fresh multi-MiB tensor per block costs
    page faults comparable to the matmul itself.

    Score modifiers act on each tile, in this order, before any mask and before the shift is
    subtracted (docs/design.md, 'The numerics of the tiled core'): ``softcap`` (natural units)
    replaces the scores ``s`` by ``softcap * tanh(s / softcap)``, and ``alibi_slopes`` (folded as
    ``(B|1, Hkv, 1, G, 1)``) add ``-slope * distance``. With ``keep_tanh`` the tile's ``tanh`` is
    kept in ``self.tanh`` for the backward.

    With ``careful`` (some input is not finite) hidden places are set to ``-inf`` by masked
    fills, never by adding a ``-inf`` bias, so a NaN a row cannot see stays out of its scores.
    """

    def __init__(
        self,
        query: Tensor,
        keys: Tensor,
        rules: Rules,
        units: Units,
        *,
        careful: bool = False,
        keep_tanh: bool = False,
    ):
        self.batch, self.kv_heads, self.q_len, self.group, _ = query.shape
        self.k_len = keys.shape[2]
        # Padding: keys past the longest length or before the earliest start are skipped,
        # keys between the latest start and the shortest length are whole; only blocks in
        # between need the per-batch mask.
        key_lengths, key_starts = rules.key_lengths, rules.key_starts
        self.key_lengths, self.key_starts = key_lengths, key_starts
        self.longest, self.shortest = self.k_len, self.k_len
        if key_lengths is not None:
            self.longest, self.shortest = int(key_lengths.max()), int(key_lengths.min())
        self.earliest, self.latest = 0, 0
        if key_starts is not None:
            self.earliest, self.latest = int(key_starts.min()), int(key_starts.max())
        self.documents = rules.documents
        self._mixed: set[tuple[int, int]] = set()  # block pairs that need the document mask
        softcap, alibi = rules.softcap, fold_slopes(rules.alibi_slopes, self.kv_heads)
        self.cap = None if softcap is None else softcap * units.unit  # in the walk's units
        self.alibi = None if alibi is None else alibi.to(keys.dtype) * -units.unit  # in units
        self.keep_tanh = keep_tanh
        self.past, self.causal, self.window = rules.past, rules.causal, rules.window
        self.mask = fold_mask(rules.mask, self.kv_heads * self.group, self.kv_heads)
        self.units, self.careful = units, careful
        self.block_q, self.block_k = rules.block
        # A block mask fixes the tiles to its own grid.
        self.block_map = block_map = rules.block_mask
        if block_map is not None:
            self.block_q, self.block_k = block_map.block
        # Enough query blocks for every CPU thread to take many, down to THREAD_ROWS rows.
        elif (threads := workers(keys.device)) > 1 and self.q_len > THREAD_ROWS:
            rows = max(THREAD_ROWS, -(-self.q_len // (THREAD_SHARES * threads)))
            self.block_q = min(self.block_q, rows)
        # Decoding and short chunks: widen the key block so the score tile, not the Python
        # loop, sets the cost; the tile stays at most block_q x block_k per group.
        elif self.q_len < self.block_q:
            self.block_k = self.block_k * self.block_q // max(self.q_len, 1)
        self.keys = keys
        self.rebased: set[tuple[int, int]] = set()  # see RowStats.rebased
        self._local = threading.local()  # query blocks may run on several threads at once
        self._edges: dict[tuple[int, int, int], Tensor] = {}
        self._distances: dict[tuple[int, int, int], Tensor] = {}

    def query_blocks(self):
        for start in range(0, self.q_len, self.block_q):
            yield range(start, min(start + self.block_q, self.q_len))

    def largest_first(self) -> list[range]:
        """The query blocks, those that see the most keys first, so that blocks handed out to
        threads one at a time end together."""

        return sorted(self.query_blocks(), key=lambda rows: len(self.key_span(rows)), reverse=True)

    def key_span(self, rows: range) -> range:
        """The keys that the causal and window rules and the padding let ``rows`` see."""
        return key_range(rows, self.longest, self.past, self.causal, self.window, self.earliest)

    def groups(self) -> list[list[range]]:
        """The backward's tasks: runs of consecutive query blocks, the run that sees the most
        keys first, each summing its key gradients into its own buffer; the runs are added in
        this order. Twice as many runs as threads where their buffers add up to at most a
        quarter more than one buffer of every key per thread, else one run per thread (why:
        docs/design.md, 'The numerics of the tiled core', threads)."""
        blocks = list(self.query_blocks())
        threads = workers(self.keys.device)
        runs, finer = self._runs(blocks, threads), self._runs(blocks, 2 * threads)
        buffers = sum(len(self.visited_keys(rows_of(run))) for run in finer)
        if threads > 1 and buffers <= 1.25 * threads * self.k_len:
            runs = finer
        return sorted(runs, key=lambda run: len(self.key_span(rows_of(run))), reverse=True)

    @staticmethod
    def _runs(blocks: list[range], count: int) -> list[list[range]]:
        """``blocks`` cut into at most ``count`` runs of consecutive blocks, as even as can be."""
        count = min(len(blocks), count)
        return [
            blocks[len(blocks) * i // count : len(blocks) * (i + 1) // count] for i in range(count)
        ]

    def visited_keys(self, rows: range) -> range:
        """The keys :meth:`key_blocks` walks over for ``rows``: their span, started on the
        block mask's grid when there is one."""
        keys = self.key_span(rows)
        if self.block_map is not None:
            keys = range(keys.start // self.block_k * self.block_k, keys.stop)
        return keys

    def key_blocks(self, rows: range):
        keys = self.visited_keys(rows)  # the block mask's empty blocks are skipped below
        starts = range(keys.start, keys.stop, self.block_k)
        shared = self._shared_documents(rows, keys) if self.documents is not None else None
        for index, start in enumerate(starts):
            if shared is not None and not shared[index]:
                continue
            grid = (rows.start // self.block_q, start // self.block_k)
            if self.block_map is not None and not self.block_map.visits(*grid):
                continue
            yield range(start, min(start + self.block_k, keys.stop))

    def _shared_documents(self, rows: range, keys: range) -> list[bool]:
        """For each key block of ``keys``, whether some row of ``rows`` shares a document with
        it in some batch element. Decided from each side's smallest and largest document id,
        so it costs O(B * (R + K)), never a rows x keys tensor. Block pairs that share one but
        are not a single document on both sides are recorded for the element-wise mask."""
        if not len(keys):
            return []
        query_documents, key_documents = self.documents
        part = query_documents[:, rows.start : rows.stop]  # (B, R)
        q_low, q_high = part.amin(dim=1, keepdim=True), part.amax(dim=1, keepdim=True)  # (B, 1)
        count = -(-len(keys) // self.block_k)
        part = key_documents[:, keys.start : keys.stop]  # (B, K')
        filler = part[:, -1:].expand(-1, count * self.block_k - len(keys))  # repeats an id
        part = torch.cat([part, filler], dim=1).view(self.batch, count, self.block_k)
        k_low, k_high = part.amin(dim=2), part.amax(dim=2)  # (B, n)
        meet = ((k_low <= q_high) & (k_high >= q_low)).any(dim=0)  # (n,)
        single = ((k_low == q_high) & (k_high == q_low)).all(dim=0)  # all four ids equal
        for index in (meet & ~single).nonzero().flatten().tolist():
            self._mixed.add((rows.start, keys.start + index * self.block_k))
        return meet.tolist()

    def rows(self, tensor: Tensor, rows: range) -> Tensor:
        """One query block of a folded (B, Hkv, Q, G, C) tensor as (B, Hkv, R * G, C)."""
        part = tensor[:, :, rows.start : rows.stop]
        return part.view(self.batch, self.kv_heads, len(rows) * self.group, tensor.shape[-1])

    def tile(self, name: str, *shape: int) -> Tensor:
        """A reused buffer of ``shape`` (contiguous), one per ``name``."""
        numel = math.prod(shape)
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[name] = self.keys.new_empty(numel)
        return buffer[:numel].view(shape)

    @property
    def tanh(self) -> Tensor:
        """This thread's last tile of ``tanh(scores / softcap)`` (``keep_tanh``)."""
        return self._local.tanh

    def unfold_tile(self, scores: Tensor, rows: range, columns: range, transposed: bool):
        """A score tile as a ``(B, Hkv, R, G, C)`` view, whichever way it was computed."""
        if transposed:
            tile = scores.view(self.batch, self.kv_heads, len(columns), len(rows), self.group)
            return tile.permute(0, 1, 3, 4, 2)
        return scores.view(self.batch, self.kv_heads, len(rows), self.group, len(columns))

    def _edge(self, rows: range, columns: range) -> Tensor:
        """0 / -inf bias ``(R, C)`` of one edge block. Adding it is several times cheaper than
        a masked fill; it depends only on the block's offset from the diagonal, so the few
        distinct ones are built once per call."""
        offset = self.past + rows.start - columns.start
        key = (len(rows), len(columns), offset)
        if key not in self._edges:
            visible = allowed(
                range(len(rows)),
                range(len(columns)),
                offset,
                self.causal,
                self.window,
                self.keys.device,
            )
            bias = torch.zeros(visible.shape, dtype=self.keys.dtype, device=self.keys.device)
            self._edges[key] = bias.masked_fill_(~visible, NEG_INF)
        return self._edges[key]

    def distance(self, rows: range, columns: range) -> Tensor:
        """``|past + i - j|`` of one block, ``(R, C)``; cached like the edges, since it depends
        only on the block's offset from the diagonal."""
        offset = self.past + rows.start - columns.start
        key = (len(rows), len(columns), offset)
        if key not in self._distances:
            self._distances[key] = distance(
                range(len(rows)), range(len(columns)), offset, self.keys.dtype, self.keys.device
            )
        return self._distances[key]

    def scores(
        self,
        q_block: Tensor,
        rows: range,
        columns: range,
        transposed: bool = False,
        keys: Tensor | None = None,
    ) -> Tensor:
        """``q_block @ key_blockᵀ`` plus the float mask, hidden places at -inf.

        ``(B*Hkv, R*G, C)``, or ``(B*Hkv, C, R*G)`` when ``transposed``: the backward wants the
        keys first, because a transposed first operand takes a slow matmul path on CPU.
        ``keys`` replaces the walk's own, laid out alike; they are cut to the query block's
        width, so a block without its extra column gives the scores themselves.
        """
        keys = self.keys if keys is None else keys
        width = q_block.shape[-1]
        k_block = as_3d(keys[:, :, columns.start : columns.stop, :width])  # (B*Hkv, C, ·)
        q_block = as_3d(q_block)  # (B*Hkv, R*G, D [+ 1])
        size = (self.batch * self.kv_heads, q_block.shape[1], k_block.shape[1])
        if transposed:
            tile = self.tile("scores_t", size[0], size[2], size[1])
            scores = torch.bmm(k_block, q_block.transpose(1, 2), out=tile)  # (B*Hkv, C, R*G)
        else:
            tile = self.tile("scores", *size)
            scores = torch.bmm(q_block, k_block.transpose(1, 2), out=tile)  # (B*Hkv, R*G, C)
        if self.cap is not None:  # bounded scores: the shift logic holds as it is
            scores.div_(self.cap).tanh_()
            if self.keep_tanh:
                self._local.tanh = self.tile("tanh", *scores.shape).copy_(scores)
            scores.mul_(self.cap)
        whole = fully_visible(rows, columns, self.past, self.causal, self.window)
        padded = columns.stop > self.shortest or columns.start < self.latest
        mixed = (rows.start, columns.start) in self._mixed
        piece = None
        if self.block_map is not None:
            piece = self.block_map.piece(rows.start // self.block_q, columns.start // self.block_k)
        plain = self.mask is None and self.alibi is None and piece is None
        if whole and not padded and not mixed and plain:
            return scores
        tile = self.unfold_tile(scores, rows, columns, transposed)  # (B, Hkv, R, G, C) view
        if self.alibi is not None:  # a float bias, added before the shift is subtracted
            tile.addcmul_(self.alibi, self.distance(rows, columns).unsqueeze(1))
        if self.mask is not None:
            part = self.mask[
                :,
                :,
                slice(rows.start, rows.stop) if self.mask.shape[2] > 1 else slice(None),
                :,
                slice(columns.start, columns.stop) if self.mask.shape[4] > 1 else slice(None),
            ]
            if part.dtype == torch.bool:
                tile.masked_fill_(~part, NEG_INF)
            else:
                # Scaled first, then added: ``add_(alpha=)`` fuses the product into the sum
                # in one layout and not in the other, and the backward's transposed tile must
                # recompute the forward's scores to the last bit.
                part = part.to(tile.dtype)
                tile.add_(part if self.units.unit == 1.0 else part * self.units.unit)
                if self.careful:  # NaN + -inf is NaN: hide what the mask hides
                    tile.masked_fill_(part == NEG_INF, NEG_INF)
        if not whole:
            if self.careful:
                tile.masked_fill_(self._edge(rows, columns).unsqueeze(1) == NEG_INF, NEG_INF)
            else:
                tile.add_(self._edge(rows, columns).unsqueeze(1))  # (R, 1, C) over the group
        if padded:
            present = padding_mask(self.key_lengths, columns, self.key_starts)  # (B, 1, 1, C)
            tile.masked_fill_(~present.unsqueeze(1), NEG_INF)  # (B, 1, 1, 1, C)
        if piece is not None:  # (b, h, R, C') of the block mask's grid
            piece = fold_mask(piece[..., : len(columns)], self.kv_heads * self.group, self.kv_heads)
            tile.masked_fill_(~piece, NEG_INF)  # (b, Hkv|1, R, G|1, C)
        if mixed:
            query_documents, key_documents = self.documents
            row_ids = query_documents[:, rows.start : rows.stop, None]  # (B, R, 1)
            same = row_ids == key_documents[:, None, columns.start : columns.stop]  # (B, R, C)
            tile.masked_fill_(~same[:, None, :, None, :], NEG_INF)  # (B, 1, R, 1, C)
        return scores


def rows_of(run: list[range]) -> range:
    """The query rows of a run of consecutive blocks."""
    return range(run[0].start, run[-1].stop)
