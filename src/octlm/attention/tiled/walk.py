"""The block walk: :class:`BlockWalk` (which key blocks each query block visits, one score tile
at a time) and its forward, FlashAttention's online softmax (:class:`OnlineSoftmax`,
:func:`walk_forward`).

Blocks that the causal/window rules, padding, packed documents or a block mask hide entirely are
never touched; blocks the rules show in full get no mask arithmetic at all; only tiles that cross
an edge get their hidden places at ``-inf``. No ``q_len x k_len`` tensor is ever made. For each
query block a per-row shift, the running sum and the unnormalised output are carried across key
blocks, and the output is normalised once at the end.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from octlm.attention.masks import allowed, distance, fully_visible, key_range, padding_mask
from octlm.attention.tiled.core import (
    NEG_INF,
    RowStats,
    Rules,
    Units,
    accumulation_dtype,
    as_3d,
    blockwise,
    fold,
    fold_keys,
    fold_mask,
    fold_slopes,
    unfold_heads,
)
from octlm.attention.tiled.threads import parallel_map, workers

# Query blocks per CPU thread, when there are enough rows: blocks are cut smaller to make them,
# down to THREAD_ROWS rows (docs/design.md, 'The numerics of the tiled core', threads).
THREAD_SHARES = 16
THREAD_ROWS = 128
# The most one block's weights may sum to (relative to the row's shift) before the shift
# moves up to that block's maximum and the block is recomputed.
CEILING = 2.0**16
# Query rows per block (heads of a group included) from which the shift rides in the matmul.
FUSED_SHIFT_ROWS = 64


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
        # keys between the latest start and the shortest length are all present; only blocks in
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
        in_full = fully_visible(rows, columns, self.past, self.causal, self.window)
        padded = columns.stop > self.shortest or columns.start < self.latest
        mixed = (rows.start, columns.start) in self._mixed
        piece = None
        if self.block_map is not None:
            piece = self.block_map.piece(rows.start // self.block_q, columns.start // self.block_k)
        plain = self.mask is None and self.alibi is None and piece is None
        if in_full and not padded and not mixed and plain:
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
        if not in_full:
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


class OnlineSoftmax:
    """The online softmax of one query block: per-row shift, running sum, unnormalised output.

    In the walk's units and relative to ``shift``: ``running_sum = sum exp(score - shift)`` and
    ``acc = sum exp(score - shift) * value`` over the keys read so far. With ``fused`` the
    shift lives in the query block's extra column (as ``-shift``), so the score matmul
    subtracts it; without, it is subtracted after the float mask is added, so a mask value far
    from the shift never cancels against it. Nothing is allocated before the first key block,
    whose sums simply become the state: decoding one token against one wide block costs a
    handful of operations.
    """

    def __init__(self, walk: BlockWalk, q_block: Tensor, rows: range, fused: bool):
        self.walk, self.q_block, self.rows, self.fused = walk, q_block, rows, fused
        self.shift = self.running_sum = self.acc = None  # (B*Hkv, R, 1), (…, 1), (…, D)
        self.unset = True  # some rows have not seen a key yet: their shift is a placeholder

    def needs_rebase(self) -> bool:
        """Whether the next block must set shifts: always first, then while a row saw nothing
        (asked only then, since asking waits for the tensors)."""
        if self.unset and self.running_sum is not None:
            self.unset = bool((self.running_sum == 0).any())
        return self.unset

    def scores(self, columns: range) -> Tensor:
        """``(B*Hkv, R, C)`` scores of one key block minus the shift, hidden places -inf."""
        scores = self.walk.scores(self.q_block, self.rows, columns)
        return scores if self.fused else scores.sub_(self.shift)

    def rebase(self, columns: range) -> Tensor:
        """Scores of one key block, with each row's shift moved up to the block's maximum.

        The scores are recomputed from nothing (not from scores relative to the old shift,
        which would round them to the old shift's precision), so the result is as exact as a
        first block. Rows that have seen no key take this block's maximum, up or down; the
        others only move up, and what they summed is rescaled by ``exp(old - new) <= 1``.
        Every weight of the block is then at most 1, so its sum cannot pass ``CEILING``.
        """
        plain = self.q_block[..., :-1] if self.fused else self.q_block  # no shift column
        scores = self.walk.scores(plain, self.rows, columns)  # (B*Hkv, R, C), absolute
        self.walk.rebased.add((self.rows.start, columns.start))
        shift = scores.amax(dim=-1, keepdim=True)  # (B*Hkv, R, 1)
        summed = self.running_sum is not None
        if summed:
            empty = self.running_sum == 0
            shift = torch.where(empty, shift, torch.maximum(self.shift, shift))
        shift.masked_fill_(shift == NEG_INF, 0.0)  # rows that see nothing here either
        if summed:
            correction = self.walk.units.exp_(self.shift - shift).masked_fill_(empty, 1.0)
            self.running_sum.mul_(correction)
            self.acc.mul_(correction)
        self.shift = shift
        if self.fused:
            self.q_block[..., -1:] = -shift.view(*self.q_block.shape[:-1], 1)
        return scores.sub_(shift)

    def add(self, weights: Tensor, block_sum: Tensor, values: Tensor) -> None:
        """Sum one block's ``weights (B*Hkv, R, C)`` and their rows ``block_sum``, over
        ``values (B*Hkv, C, D)``."""
        if self.running_sum is None:
            self.running_sum, self.acc = block_sum, torch.bmm(weights, values)  # (…, 1), (…, D)
        else:
            self.running_sum += block_sum
            self.acc.baddbmm_(weights, values)

    def see_nothing(self, head_size: int) -> None:
        """The state of rows that meet no key block: nothing summed, shift 0."""
        self.shift = self.q_block.new_zeros(
            self.walk.batch * self.walk.kv_heads, self.q_block.shape[2], 1
        )
        self.running_sum = torch.zeros_like(self.shift)  # (B*Hkv, R, 1)
        self.acc = self.shift.new_zeros(*self.shift.shape[:-1], head_size)  # (B*Hkv, R, D)

    def absorb(self, logits: Tensor) -> None:
        """One more score per row, ``(B*Hkv, R, 1)`` in units, that joins the sum and carries
        no value: an attention sink. The shift moves up to it where it is larger (rows that
        saw no key take it), rescaling what was summed by ``exp(old - new) <= 1``."""
        empty = self.running_sum == 0
        shift = torch.where(empty, logits, torch.maximum(self.shift, logits))
        shift.masked_fill_(shift == NEG_INF, 0.0)  # a -inf sink and no key: nothing is summed
        correction = self.walk.units.exp_(self.shift - shift).masked_fill_(empty, 1.0)
        self.running_sum.mul_(correction).add_(self.walk.units.exp_(logits - shift))
        self.acc.mul_(correction)
        self.shift = shift

    def output(self) -> Tensor:
        """Normalised output ``(B*Hkv, R, D)``; rows that saw no key are 0."""
        # A row that saw a key sums to at least 1 (its shift's own weight); one that saw none
        # has acc = 0, and 0 / tiny = 0.
        return self.acc.div_(self.running_sum.clamp_min(torch.finfo(self.acc.dtype).tiny))


def walk_forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, RowStats]:
    """The output ``(B, H, Q, D)`` in the accumulation dtype and the exact row statistics, by
    FlashAttention's online softmax over the tiles of a :class:`BlockWalk`.

    Softmax is invariant to a per-row shift, so the shift need not be the exact running
    maximum: it is set from each row's first visible block and moves up only when a later
    block's weights sum past ``CEILING`` (or overflow), in which case that block is recomputed
    against the new shift. The usual block therefore costs no maximum pass and no rescale.

    Inputs are assumed finite, and checked only afterwards: a NaN or infinity that reached
    any row shows up as NaN in the output (O(Q·D) to look at, against O(K·D) for the inputs).
    Only then is the call run again with the masked fills that keep a hidden NaN out of the
    rows that cannot see it.
    """
    out, rows = _walk(query, key, value, rules, careful=False)
    if bool(out.isnan().any()):
        out, rows = _walk(query, key, value, rules, careful=True)
    return out, rows


def _walk(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules, *, careful: bool
) -> tuple[Tensor, RowStats]:
    """One pass of :func:`walk_forward`; ``careful`` hides places by fills, never by sums."""
    mask, scale, sinks = rules.mask, rules.scale, rules.sinks
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    units = Units.choose(rules)
    float_mask = mask is not None and mask.is_floating_point()
    rows_per_block = min(rules.block[0], query.shape[2]) * (heads // kv_heads)
    # The fused shift costs a copy of the keys with a column of ones: worth it when each key
    # block meets many query rows, not when decoding one token against a long cache. A float
    # mask must be added before the shift is subtracted, so it is never fused; nor are the
    # score modifiers, which act on the scores themselves.
    modified = rules.softcap is not None or rules.alibi_slopes is not None
    fused = rows_per_block >= FUSED_SHIFT_ROWS and not float_mask and not modified
    extra = 0.0 if fused else None
    folded = fold(query, kv_heads, scale * units.unit, dtype, extra)  # (B, Hkv, Q, G, D [+ 1])
    keys = fold_keys(key, dtype, 1.0 if fused else None)  # (B, Hkv, K, D [+ 1])
    value = blockwise(value.to(dtype))  # (B, Hkv, K, D)
    broken = None
    if careful:
        # 0 x NaN is NaN: a value a row cannot see must not reach it through a zero weight.
        # Values are summed clean, and what a row can see of the rest is put back at the
        # end: per dimension, NaN where it sees a NaN or infinities of both signs, else the
        # infinity it sees (as the definition gives, whatever the tiles).
        kinds = (value.isnan(), value == float("inf"), value == float("-inf"))
        value = value.masked_fill(~value.isfinite(), 0.0)
        broken = as_3d(torch.cat(kinds, dim=-1).to(dtype))  # (B*Hkv, K, 3 * D)
    walk = BlockWalk(folded, keys, rules, units, careful=careful)
    if sinks is not None:
        sinks = (sinks.to(dtype) * units.unit).view(1, kv_heads, 1, -1)  # (1, Hkv, 1, G)

    def attend(rows: range) -> tuple[Tensor, Tensor, Tensor]:
        """One query block's output ``(B, Hkv, R, G, D)``, shift and sum ``(B, Hkv, R, G)``;
        blocks run concurrently on CPU."""
        state = OnlineSoftmax(walk, walk.rows(folded, rows), rows, fused)
        poison = None
        for columns in walk.key_blocks(rows):
            rebased = state.needs_rebase()
            scores = state.rebase(columns) if rebased else state.scores(columns)
            visible = scores != NEG_INF if careful else None  # (B*Hkv, R, C)
            weights = units.exp_(scores)  # (B*Hkv, R, C), in place of the scores
            block_sum = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, R, 1)
            if not rebased and not bool(block_sum.max() <= CEILING):  # also inf and NaN
                # A score rose far above its row's shift: redo the block with the shift moved.
                weights = units.exp_(state.rebase(columns))
                block_sum = weights.sum(dim=-1, keepdim=True)
            keys_here = slice(columns.start, columns.stop)
            state.add(weights, block_sum, as_3d(value[:, :, keys_here]))
            if careful:
                seen_broken = torch.bmm(visible.to(dtype), broken[:, keys_here]) > 0
                poison = seen_broken if poison is None else poison | seen_broken
        if state.running_sum is None:  # the rows met no key block
            state.see_nothing(head_size)
        if sinks is not None:
            shape = (walk.batch, kv_heads, len(rows), walk.group)
            state.absorb(sinks.expand(shape).reshape(walk.batch * kv_heads, -1, 1))
        result = state.output()  # (B*Hkv, R, D)
        if poison is not None:  # a row already NaN (a NaN score) stays NaN
            nan, high, low = poison.split(head_size, dim=-1)  # (B*Hkv, R, D) each
            nan = nan | (high & low) | result.isnan()
            result.masked_fill_(high, float("inf")).masked_fill_(low, float("-inf"))
            result.masked_fill_(nan, float("nan"))
        shape = (walk.batch, kv_heads, len(rows), walk.group)
        total = state.running_sum.view(shape)
        return result.view(*shape, head_size), state.shift.view(shape), total

    blocks = walk.largest_first()
    if len(blocks) == 1:  # decoding, short chunks: the block's own tensors, no copy
        out, shift, total = attend(blocks[0])
    else:
        out = folded.new_empty(*folded.shape[:-1], head_size)  # (B, Hkv, Q, G, D)
        shift = folded.new_empty(folded.shape[:-1])  # (B, Hkv, Q, G), in units
        total = torch.empty_like(shift)  # (B, Hkv, Q, G)

        def write(rows: range) -> None:
            for full, part in zip((out, shift, total), attend(rows), strict=True):
                full[:, :, rows.start : rows.stop] = part

        parallel_map(write, blocks, query.device)
    rows = RowStats(
        unfold_heads(shift), unfold_heads(total), units, careful, frozenset(walk.rebased), fused
    )
    return unfold_heads(out), rows


def rows_of(run: list[range]) -> range:
    """The query rows of a run of consecutive blocks."""
    return range(run[0].start, run[-1].stop)
