"""The block engine: FlashAttention's online softmax and its recomputing backward, in PyTorch.

Queries and keys are cut into blocks. For each query block a per-row shift, the running sum
and the unnormalised output are carried across key blocks (:class:`OnlineSoftmax`), and the
output is normalised once at the end. :class:`BlockWalk` says which key blocks a query block
visits (blocks that the causal/window rules, padding or packed documents hide entirely are never
touched) and computes one score tile with the hidden places at ``-inf``; blocks the rules show
whole get no mask arithmetic at all. No ``q_len x k_len`` tensor is ever made.

:func:`attend_forward` and :func:`attend_backward` are the steps as functions, over one chunk
of queries against one chunk of keys under one :class:`Rules`; :func:`merge` combines partial
results over disjoint key chunks exactly. ``octlm.attention.tiled`` wraps them in an autograd
function and the ring (``octlm.attention.ring``) runs them across processes. The numerics
(why a shift that is not the running maximum, why base 2, what is exact) are in
docs/design.md §7.

Layout inside: the query heads that share one key/value head are folded into the rows of a
block, ``(B, H, Q, D) -> (B, Hkv, Q, G, D)`` viewed as ``(B*Hkv, Q*G, D)`` per block, so GQA
costs one matmul per block with no copy of key or value. ``G = heads // kv_heads``.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from octlm.attention.block_masks import BlockMask
from octlm.attention.masks import (
    allowed,
    as_4d,
    distance,
    fully_visible,
    key_range,
    padding_mask,
)
from octlm.attention.threads import parallel_map, workers
from octlm.attention.tiles import DEFAULT_BLOCK

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
# The most one block's weights may sum to (relative to the row's shift) before the shift
# moves up to that block's maximum and the block is recomputed.
CEILING = 2.0**16
# Query blocks per CPU thread, when there are enough rows: blocks are cut smaller to make them,
# down to THREAD_ROWS rows. Many blocks per thread let a thread that lost its core leave its
# share to the others; blocks below THREAD_ROWS rows cost more in Python than they save
# (docs/benchmarks.md, threads and tiles).
THREAD_SHARES = 16
THREAD_ROWS = 128
# Score offsets (float mask values, sinks) from which scores are kept in natural units.
LARGE_OFFSET = 64.0
# Query rows per block (heads of a group included) from which the shift rides in the matmul.
FUSED_SHIFT_ROWS = 64
# The largest shift (in score units) the backward lets ride in the matmul: inside it, the
# shift's rounding joins the sum of products; past it, scores are formed first, as naive does.
FUSED_SHIFT_LIMIT = 64.0


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Units:
    """The units scores are kept in: ``unit`` times natural units, exponentiated in base
    ``e ** (1 / unit)``. Base 2 (``unit = log2(e)``) by default, because ``exp2`` is about
    twice as cheap as ``exp`` on CPU. Natural units where a term joins the scores (a float
    mask, ALiBi, a softcap; docs/design.md §7): the tile is then formed as naive forms it, to
    the last bit where the matmul sums alike. And where the sinks offset scores by finite
    values of ``LARGE_OFFSET`` or more: there the offset's rounding, not the scores', sets
    the error, and scaling by ``log2(e)`` can carry a sum into the next binade and double it;
    and a value near ``finfo.max`` would overflow, where it is still a score and must keep its
    place in the softmax."""

    unit: float

    @staticmethod
    def choose(rules: Rules) -> Units:
        mask, sinks = rules.mask, rules.sinks
        if rules.softcap is not None or rules.alibi_slopes is not None:
            return Units(1.0)
        if mask is not None and mask.is_floating_point():
            return Units(1.0)
        if sinks is None or not sinks.numel():
            return Units(LOG2E)
        sizes = sinks.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs()  # -inf hides in any
        return Units(1.0) if float(sizes.max()) >= LARGE_OFFSET else Units(LOG2E)  # base

    def exp_(self, x: Tensor) -> Tensor:
        return x.exp2_() if self.unit != 1.0 else x.exp_()

    def log(self, x: Tensor) -> Tensor:
        return x.log2() if self.unit != 1.0 else x.log()


@dataclass
class RowStats:
    """What the forward knows of each query row's softmax, ``(B, H, Q)`` each.

    ``shift`` is in the forward's units and ``total = sum exp(score - shift)`` over the keys the
    row sees (0 when it sees none). ``lse = (shift + log total) / unit``, but the pair is exact
    where ``lse`` is not: with scores near ``finfo.min``, ``score - lse`` rounds away ``log total``.
    """

    shift: Tensor
    total: Tensor
    units: Units
    careful: bool = False  # the forward met a non-finite input: hide by masked fills
    # The tiles, by (first row, first key), whose scores the forward formed whole and then
    # shifted (a rebase), and whether its operands carried the shift column: the backward
    # forms those tiles again from operands laid out the same way, so their probabilities are
    # the forward's bit for bit (a row whose only score is its shift gets exactly 1).
    rebased: frozenset[tuple[int, int]] = frozenset()
    shift_column: bool = False

    def lse(self) -> Tensor:
        """Natural log-sum-exp; ``-inf`` for rows that see no key."""
        return (self.shift + self.units.log(self.total)) / self.units.unit


class BlockWalk:
    """Which key blocks each query block visits, and one score tile at a time.

    Works on inputs in the folded layout: ``query (B, Hkv, Q, G, D [+ 1])`` and ``keys (B, Hkv,
    K, D [+ 1])`` may carry one extra column each (see :func:`_fold`); ``mask`` is as
    :func:`_fold_mask` returns. ``past`` places query row ``i`` at key position ``past + i``.
    Keys outside ``[key_starts[b], key_lengths[b])`` are padding. With ``documents = (query
    documents (B, Q), key documents (B, K))`` a row sees only keys of its own document: a block
    pair whose document ranges do not meet is skipped, and one that lies inside a single
    document (in every batch element) needs no document mask.
    Score tiles are written into one reused buffer: a fresh multi-MiB tensor per block costs
    page faults comparable to the matmul itself.

    Score modifiers act on each tile, in this order, before any mask and before the shift is
    subtracted (docs/design.md §7): ``softcap`` (natural units) replaces the scores ``s`` by
    ``softcap * tanh(s / softcap)``, and ``alibi`` (folded slopes ``(B|1, Hkv, 1, G, 1)``)
    adds ``-slope * distance``. With ``keep_tanh`` the tile's ``tanh`` is kept in
    ``self.tanh`` for the backward.

    With ``careful`` (some input is not finite) hidden places are set to ``-inf`` by masked
    fills, never by adding a ``-inf`` bias, so a NaN a row cannot see stays out of its scores.
    """

    def __init__(
        self, query, keys, past, causal, window, mask, block, units, key_lengths=None,
        careful=False, key_starts=None, documents=None, softcap=None, alibi=None,
        keep_tanh=False, block_map=None,
    ):  # fmt: skip
        self.batch, self.kv_heads, self.q_len, self.group, _ = query.shape
        self.k_len = keys.shape[2]
        # Padding: keys past the longest length or before the earliest start are skipped,
        # keys between the latest start and the shortest length are whole; only blocks in
        # between need the per-batch mask.
        self.key_lengths, self.key_starts = key_lengths, key_starts
        self.longest, self.shortest = self.k_len, self.k_len
        if key_lengths is not None:
            self.longest, self.shortest = int(key_lengths.max()), int(key_lengths.min())
        self.earliest, self.latest = 0, 0
        if key_starts is not None:
            self.earliest, self.latest = int(key_starts.min()), int(key_starts.max())
        self.documents = documents
        self._mixed: set[tuple[int, int]] = set()  # block pairs that need the document mask
        self.cap = None if softcap is None else softcap * units.unit  # in the walk's units
        self.alibi = None if alibi is None else alibi.to(keys.dtype) * -units.unit  # in units
        self.keep_tanh = keep_tanh
        self.past, self.causal, self.window, self.mask = past, causal, window, mask
        self.units, self.careful = units, careful
        self.block_q, self.block_k = block
        # A block mask fixes the tiles to its own grid.
        self.block_map = block_map
        if block_map is not None:
            self.block_q, self.block_k = block_map.block
        # Enough query blocks for every CPU thread to take many (see threads.py), down to
        # THREAD_ROWS rows a block: blocks are handed out one at a time, and small last ones
        # let a thread that lost its core to another process finish with the rest.
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
        keys first. Each run sums its key gradients into its own buffer, over the keys its
        rows see, and the runs are added in this order: the result does not depend on which
        thread ran what. Runs are handed out one at a time, so a thread slowed by another
        process takes fewer; twice as many runs as threads give it more to leave, and are
        taken when their buffers add up to at most a quarter more than one buffer of every
        key per thread (causal self-attention, where early runs see few keys), else one run
        per thread."""
        blocks = list(self.query_blocks())
        threads = workers(self.keys.device)
        runs, finer = self._runs(blocks, threads), self._runs(blocks, 2 * threads)
        buffers = sum(len(self.visited_keys(_rows_of(run))) for run in finer)
        if threads > 1 and buffers <= 1.25 * threads * self.k_len:
            runs = finer
        return sorted(runs, key=lambda run: len(self.key_span(_rows_of(run))), reverse=True)

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
                range(len(rows)), range(len(columns)), offset, self.causal, self.window,
                self.keys.device,
            )  # fmt: skip
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
            )  # fmt: skip
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
        k_block = _as_3d(keys[:, :, columns.start : columns.stop, :width])  # (B*Hkv, C, ·)
        q_block = _as_3d(q_block)  # (B*Hkv, R*G, D [+ 1])
        size = (self.batch * self.kv_heads, q_block.shape[1], k_block.shape[1])
        if transposed:
            tile = self.tile("scores_t", size[0], size[2], size[1])
            scores = torch.bmm(k_block, q_block.transpose(1, 2), out=tile)  # (B*Hkv, C, R*G)
        else:
            tile = self.tile("scores", *size)
            scores = torch.bmm(q_block, k_block.transpose(1, 2), out=tile)  # (B*Hkv, R*G, C)
        if self.cap is not None:  # bounded scores: the shift logic of §7 holds as it is
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
            piece = _fold_mask(
                piece[..., : len(columns)], self.kv_heads * self.group, self.kv_heads
            )
            tile.masked_fill_(~piece, NEG_INF)  # (b, Hkv|1, R, G|1, C)
        if mixed:
            query_documents, key_documents = self.documents
            row_ids = query_documents[:, rows.start : rows.stop, None]  # (B, R, 1)
            same = row_ids == key_documents[:, None, columns.start : columns.stop]  # (B, R, C)
            tile.masked_fill_(~same[:, None, :, None, :], NEG_INF)  # (B, 1, R, 1, C)
        return scores


def _fold(x: Tensor, kv_heads: int, scale: float, dtype: torch.dtype, extra: float | None):
    """(B, H, L, D) -> (B, Hkv, L, G, D [+ 1]) contiguous, in ``dtype``, times ``scale``.

    The upcast comes first, so low-precision inputs are scaled in the accumulation dtype. With
    ``extra`` the last dimension gains one column of that value. For keys it is 1, and for
    queries it holds each row's shift, so one matmul gives ``scores - shift`` and the
    subtraction costs no pass over the tile.
    """
    batch, heads, length, head_size = x.shape
    folded = x.view(batch, kv_heads, heads // kv_heads, length, head_size).transpose(2, 3)
    if extra is None:
        folded = folded.to(dtype)
        return (folded if scale == 1.0 else folded * scale).contiguous()  # keys: often no copy
    out = folded.new_empty(*folded.shape[:-1], head_size + 1, dtype=dtype)
    out[..., :head_size] = folded
    if scale != 1.0:
        out[..., :head_size] *= scale
    out[..., head_size] = extra
    return out


def _keys(key: Tensor, dtype: torch.dtype, extra: float | None) -> Tensor:
    """Keys ``(B, Hkv, K, D [+ 1])`` in ``dtype`` for the block matmuls, with a column of
    ``extra`` when given (see :func:`_fold`), copied only when that is needed."""
    if extra is None:
        return _blockwise(key.to(dtype))
    head_size = key.shape[-1]
    out = key.new_empty(*key.shape[:-1], head_size + 1, dtype=dtype)
    out[..., :head_size] = key
    out[..., head_size] = extra
    return out


def _rows_of(run: list[range]) -> range:
    """The query rows of a run of consecutive blocks."""
    return range(run[0].start, run[-1].stop)


def _blockwise(x: Tensor) -> Tensor:
    """``x (B, Hkv, K, D)`` itself when its rows are contiguous and batch and heads merge, as
    in a KV cache's view of its longer buffer; else a contiguous copy. The block matmuls need
    no more, and decoding one token should not copy the whole cache."""
    rows = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    return x if rows and x.stride(0) == x.stride(1) * x.shape[1] else x.contiguous()


def unfold_heads(rows: Tensor) -> Tensor:
    """(B, Hkv, Q, G, ...) -> (B, H, Q, ...): the inverse of the fold, for outputs."""
    batch, kv_heads, q_len, group = rows.shape[:4]
    return rows.transpose(2, 3).reshape(batch, kv_heads * group, q_len, *rows.shape[4:])


def _fold_rows(x: Tensor, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """A per-row statistic (B, H, Q) as (B, Hkv, Q, G, 1), to sit beside folded queries."""
    return _fold(x.unsqueeze(-1), kv_heads, 1.0, dtype, None)


def _fold_mask(mask: Tensor | None, heads: int, kv_heads: int) -> Tensor | None:
    """A mask broadcastable to (B, H, Q, K) as (b, Hkv|1, Q|1, G|1, K|1) to match the fold."""
    if mask is None:
        return None
    mask = as_4d(mask)  # (b, h, q, k)
    if mask.shape[1] == 1:
        return mask.unsqueeze(3)  # (b, 1, q, 1, k)
    batch, _, q_len, k_len = mask.shape
    return mask.view(batch, kv_heads, heads // kv_heads, q_len, k_len).transpose(2, 3)


def _as_3d(x: Tensor) -> Tensor:
    """(B, Hkv, R, C) -> (B*Hkv, R, C) view, for the batched matmuls.

    A view, never a copy: the in-place matmuls write through it. The callers keep their
    tensors contiguous, so slicing rows or keys keeps the first two dims mergeable.
    """
    return x.view(-1, *x.shape[-2:]) if x.dim() == 4 else x


def _row_sums(tile: Tensor, far: Tensor) -> Tensor:
    """``sum over keys of tile * far``: ``(B, Hkv, R, G, C)`` by ``(R, 1, C)`` -> ``(B, Hkv, R,
    G)``, accumulated in float64 (the products cancel, and their weights grow with length)."""
    return (tile * far).sum(dim=-1, dtype=torch.float64)


def _all_finite(*tensors: Tensor | None) -> bool:
    """Whether the NaN-safe masking can be skipped, for a caller with no forward to ask."""
    return all(t is None or not t.is_floating_point() or bool(t.isfinite().all()) for t in tensors)


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


@dataclass(frozen=True, kw_only=True, eq=False)
class Rules:
    """What one chunk of queries sees of one chunk of keys, and how its scores are formed.

    Query row ``i`` sits at key position ``past + i`` of the key chunk; keys outside
    ``[key_starts[b], key_lengths[b])`` are padding, and ``documents = (query ids (B, Q), key
    ids (B, K))`` restricts each row to keys of its own document. ``block`` is the tile
    ``(block_q, block_k)``; the rest are the checked keywords of ``tiled_attention`` (the
    score modifiers ``softcap``, ``alibi_slopes`` and ``sinks`` among them).
    """

    past: int
    scale: float
    causal: bool = True
    window: int = 0
    mask: Tensor | None = None
    block: tuple[int, int] = DEFAULT_BLOCK
    key_lengths: Tensor | None = None
    key_starts: Tensor | None = None
    documents: tuple[Tensor, Tensor] | None = None
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    block_mask: BlockMask | None = None


def _block_steps(steps: Callable) -> Callable:
    """Run the block steps eagerly and with autocast off on the query's device.

    They choose their own precision (every block in float32 or float64); under autocast the
    first block's matmul would come back in bfloat16 and the in-place ones that follow refuse
    to mix the two. And their loop is Python over tile bounds, which ``torch.compile`` would
    trace as symbols and fail on: in a compiled model they are a graph break, run as written.
    """

    def eager(query: Tensor, *args, **kwargs):
        if not torch.is_autocast_enabled(query.device.type):
            return steps(query, *args, **kwargs)
        with torch.autocast(query.device.type, enabled=False):
            return steps(query, *args, **kwargs)

    @functools.wraps(steps)
    def run(query: Tensor, *args, **kwargs):
        # Marked at the call, not at import: torch.compiler.disable imports dynamo (seconds,
        # and Triton with it), which a plain ``import octlm`` should not pay for.
        if torch.compiler.is_compiling():
            return torch.compiler.disable(eager)(query, *args, **kwargs)
        return eager(query, *args, **kwargs)

    return run


@_block_steps
def forward_rows(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, RowStats]:
    """The forward block steps; ``out`` and the exact row statistics. See :func:`attend_forward`.

    Inputs are assumed finite, and checked only afterwards: a NaN or infinity that reached
    any row shows up as NaN in the output (O(Q·D) to look at, against O(K·D) for the inputs,
    which is the whole cost of decoding one token). Only then is the call run again with the
    masked fills that keep a hidden NaN out of the rows that cannot see it.
    """
    out, rows = _forward_pass(query, key, value, rules, careful=False)
    if bool(out.isnan().any()):
        out, rows = _forward_pass(query, key, value, rules, careful=True)
    return out, rows


def _forward_pass(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules, *, careful: bool
) -> tuple[Tensor, RowStats]:
    past, causal, window, mask, scale, block = (
        rules.past, rules.causal, rules.window, rules.mask, rules.scale, rules.block,
    )  # fmt: skip
    key_lengths, key_starts, documents = rules.key_lengths, rules.key_starts, rules.documents
    softcap, alibi_slopes, block_mask = rules.softcap, rules.alibi_slopes, rules.block_mask
    sinks = rules.sinks
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    units = Units.choose(rules)
    if 0 in query.shape or 0 in key.shape:  # no rows, or no keys to see: zeros, as naive gives
        nothing = query.new_zeros(query.shape[:-1], dtype=dtype)  # (B, H, Q)
        if sinks is None:
            return query.new_zeros(query.shape, dtype=dtype), RowStats(nothing, nothing, units)
        # The sink alone is in each row's denominator: its log-sum-exp is the sink's logit
        # (-inf for a -inf sink, which sums nothing).
        logits = (sinks.to(dtype) * units.unit).view(1, -1, 1).expand_as(nothing)  # (B, H, Q)
        shift = logits.masked_fill(logits == NEG_INF, 0.0)
        rows = RowStats(shift, units.exp_(logits - shift), units)
        return query.new_zeros(query.shape, dtype=dtype), rows
    if not careful and _sees_every_key(query, key, rules):
        return _one_row_each(query, key, value, scale * units.unit, units)
    float_mask = mask is not None and mask.is_floating_point()
    rows_per_block = min(block[0], query.shape[2]) * (heads // kv_heads)
    # The fused shift costs a copy of the keys with a column of ones: worth it when each key
    # block meets many query rows, not when decoding one token against a long cache. A float
    # mask must be added before the shift is subtracted, so it is never fused; nor are the
    # score modifiers, which act on the scores themselves.
    modified = softcap is not None or alibi_slopes is not None
    fused = rows_per_block >= FUSED_SHIFT_ROWS and not float_mask and not modified
    extra = 0.0 if fused else None
    folded = _fold(query, kv_heads, scale * units.unit, dtype, extra)  # (B, Hkv, Q, G, D [+ 1])
    keys = _keys(key, dtype, 1.0 if fused else None)  # (B, Hkv, K, D [+ 1])
    value = _blockwise(value.to(dtype))  # (B, Hkv, K, D)
    broken = None
    if careful:
        # 0 x NaN is NaN: a value a row cannot see must not reach it through a zero weight.
        # Values are summed clean, and what a row can see of the rest is put back at the
        # end: per dimension, NaN where it sees a NaN or infinities of both signs, else the
        # infinity it sees (as the definition gives, whatever the tiles).
        kinds = (value.isnan(), value == float("inf"), value == float("-inf"))
        value = value.masked_fill(~value.isfinite(), 0.0)
        broken = _as_3d(torch.cat(kinds, dim=-1).to(dtype))  # (B*Hkv, K, 3 * D)
    walk = BlockWalk(
        folded, keys, past, causal, window, _fold_mask(mask, heads, kv_heads), block, units,
        key_lengths, careful, key_starts, documents, softcap,
        _fold_slopes(alibi_slopes, kv_heads), block_map=block_mask,
    )  # fmt: skip
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
            state.add(weights, block_sum, _as_3d(value[:, :, keys_here]))
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
            for whole, part in zip((out, shift, total), attend(rows), strict=True):
                whole[:, :, rows.start : rows.stop] = part

        parallel_map(write, blocks, query.device)
    rows = RowStats(
        unfold_heads(shift), unfold_heads(total), units, careful, frozenset(walk.rebased), fused
    )
    return unfold_heads(out), rows


def _sees_every_key(query: Tensor, key: Tensor, rules: Rules) -> bool:
    """Whether this is one query row per head (decoding a token) that sees every key: then
    its attention is a single softmax, whatever the tiles."""
    keys = range(key.shape[2])
    if query.shape[2] != 1 or not fully_visible(
        range(1), keys, rules.past, rules.causal, rules.window
    ):
        return False
    structure = (rules.mask, rules.key_lengths, rules.key_starts, rules.documents)
    modifiers = (rules.softcap, rules.alibi_slopes, rules.sinks, rules.block_mask)
    return all(x is None for x in (*structure, *modifiers))


def _one_row_each(query, key, value, scale: float, units: Units) -> tuple[Tensor, RowStats]:
    """Decoding one token against every key: one softmax over the keys, its operations issued
    back to back. The block loop would give the same numbers (its first block sets the shift
    to the maximum just as here), but on CPU each large operation that follows a pause in
    Python starts slower, and the loop's bookkeeping is such a pause between every two."""
    batch, heads, _, head_size = query.shape
    dtype = accumulation_dtype(query.dtype)
    rows = (query.to(dtype) * scale).reshape(-1, heads // key.shape[1], head_size)  # (B*Hkv, G, D)
    keys = _as_3d(_keys(key, dtype, None))  # (B*Hkv, K, D)
    weights = torch.bmm(rows, keys.transpose(1, 2))  # (B*Hkv, G, K)
    shift = weights.amax(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    units.exp_(weights.sub_(shift))
    total = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, G, 1)
    out = torch.bmm(weights, _as_3d(_blockwise(value.to(dtype)))).div_(total)  # (B*Hkv, G, D)
    # Formed whole and shifted, as the loop's first (and widest) block, from plain operands.
    shift, total = shift.view(batch, heads, 1), total.view(batch, heads, 1)
    stats = RowStats(shift, total, units, rebased=frozenset({(0, 0)}), shift_column=False)
    return out.view(batch, heads, 1, head_size), stats


def attend_forward(
    query: Tensor, key: Tensor, value: Tensor, rules: Rules
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over one chunk of keys: the forward block steps as a function.

    ``query (B, H, Q, D)``, ``key``/``value (B, Hkv, K, D)``, under ``rules``. Inputs are not
    validated here (the public functions do that). Returns ``out (B, H, Q, D)`` normalised,
    and ``lse (B, H, Q)``, both in the accumulation dtype; rows that see no key get
    ``out = 0`` and ``lse = -inf``. Two such partial results over disjoint key chunks combine
    exactly with :func:`merge`.

    Softmax is invariant to a per-row shift, so the shift need not be the exact running
    maximum: it is set from each row's first visible block and moves up only when a later
    block's weights sum past ``CEILING`` (or overflow), in which case that block is recomputed
    against the new shift. The usual block therefore costs no maximum pass and no rescale.
    """
    out, rows = forward_rows(query, key, value, rules)
    return out, rows.lse()


@_block_steps
def attend_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    lse: Tensor | RowStats,
    delta: Tensor,
    rules: Rules,
    *,
    grad_mask: Tensor | None = None,
    grad_alibi: Tensor | None = None,
    residue: Tensor | None = None,
    spread: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one query chunk against one key chunk: the backward block steps.

    ``lse`` (or the forward's exact :class:`RowStats`) and ``delta = rowsum(grad_out * out)``
    are ``(B, H, Q)`` over *all* keys the queries attend to (global, when keys are split across
    calls or processes), so each chunk's probabilities ``exp(score - shift) / total`` are
    exact. Returns ``dq (B, H, Q, D)`` and ``dk``/``dv (B, Hkv, K, D)`` in the accumulation
    dtype, summed over each GQA group. When ``grad_mask`` (folded like the mask, full size) is
    given, the scores' gradient is written into it; when ``grad_alibi`` (``(B, Hkv, G)``,
    whatever the slopes' shape) is, the gradient of the ALiBi slopes is added to it. Sinks
    change nothing here (they live in the row statistics); their gradient is
    :func:`sink_gradient`.

    ``delta`` comes from the rounded output, so each row's ``ds`` sums to a little more or less
    than it should; the slopes' and sinks' gradients multiply that residue (by distances, over
    every row). ``residue`` (``(B, Hkv, Q, G)`` float64, when given) receives what each row's
    ``ds`` sums to over these keys, and ``spread`` (the same, with ALiBi) each row's mean
    distance ``sum p * distance``, from which :func:`delta_error` and the caller correct them.
    """
    past, causal, window, mask, scale, block = (
        rules.past, rules.causal, rules.window, rules.mask, rules.scale, rules.block,
    )  # fmt: skip
    key_lengths, key_starts, documents = rules.key_lengths, rules.key_starts, rules.documents
    softcap, alibi_slopes, block_mask = rules.softcap, rules.alibi_slopes, rules.block_mask
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    if 0 in query.shape or 0 in key.shape:
        zeros = (torch.zeros_like(x, dtype=dtype) for x in (query, key, value))
        return tuple(zeros)
    if isinstance(lse, Tensor):  # the log-sum-exp alone: shift by it, total 1
        units = Units.choose(rules)
        seen = lse > NEG_INF
        shift = (lse.to(dtype) * units.unit).masked_fill(~seen, 0.0)
        lse = RowStats(shift, seen.to(dtype), units, careful=not _all_finite(query, key, value))
    units = lse.units
    float_mask = mask is not None and mask.is_floating_point()
    modified = softcap is not None or alibi_slopes is not None
    fused = not float_mask and not modified and bool(lse.shift.abs().max() <= FUSED_SHIFT_LIMIT)
    folded = _fold(query, kv_heads, scale * units.unit, dtype, 0.0 if fused else None)
    shift = _fold_rows(lse.shift, kv_heads, dtype)  # (B, Hkv, Q, G, 1), in units
    if fused:  # the extra column holds -shift, so the matmul yields scores - shift
        folded[..., head_size:] = -shift
    # p = exp(score - shift) / total. The 1 / total rides on grad_out and delta (rows that see
    # nothing get 0), so no pass over the tile divides: dv += e @ (do / total) and
    # ds = e * (v @ (do / total) - delta / total).
    total = _fold_rows(lse.total, kv_heads, dtype)  # (B, Hkv, Q, G, 1)
    inverse = torch.where(total > 0, 1.0 / total, 0.0)
    keys = _keys(key, dtype, 1.0 if fused else None)  # (B, Hkv, K, D [+ 1])
    grad_folded = _fold(grad_out, kv_heads, 1.0, dtype, None) * inverse  # (B, Hkv, Q, G, D)
    delta = _fold_rows(delta, kv_heads, dtype) * inverse  # (B, Hkv, Q, G, 1)
    value = _blockwise(value.to(dtype))  # (B, Hkv, K, D)
    # The forward's rebased tiles are formed again from operands laid out as its own were (with
    # or without the shift column), so that their scores are its scores to the last bit.
    whole_queries, whole_keys = folded, keys
    if lse.rebased and lse.shift_column != fused:
        column = 0.0 if lse.shift_column else None
        whole_queries = _fold(query, kv_heads, scale * units.unit, dtype, column)
        whole_keys = _keys(key, dtype, None if column is None else 1.0)
    walk = BlockWalk(
        folded, keys, past, causal, window, _fold_mask(mask, heads, kv_heads), block, units,
        key_lengths, lse.careful, key_starts, documents, softcap,
        _fold_slopes(alibi_slopes, kv_heads), keep_tanh=True, block_map=block_mask,
    )  # fmt: skip
    # Keys as (B*Hkv, D, K), so dqᵀ += keysᵀ @ dsᵀ has no transposed first operand.
    key_t = _as_3d(keys[..., :head_size].transpose(-2, -1).contiguous())  # (B*Hkv, D, K)
    value = _as_3d(value)  # (B*Hkv, K, D)
    if not _all_finite(key_t, value):  # one pass, O(K·D), against the backward's O(Q·K·D)
        # 0 x NaN is NaN: a key or value that no row sees must not reach a gradient through a
        # zero probability (the forward's output can be clean while one sits in padding). One
        # that a row sees still does, through its probabilities or through delta (that row's
        # output is NaN).
        key_t = key_t.masked_fill(~key_t.isfinite(), 0.0)
        value = value.masked_fill(~value.isfinite(), 0.0)
    grad_query = torch.empty_like(grad_folded)  # (B, Hkv, Q, G, D)

    def attend(blocks: list[range]) -> tuple[range, Tensor, Tensor, Tensor | None]:
        """The gradients from a run of query blocks; ``dk``, ``dv`` (and the slopes') summed
        over them into their own tensors, over the ``seen`` keys, so that runs can go on at
        once."""
        seen = walk.visited_keys(_rows_of(blocks))
        grad_key = value.new_zeros(value.shape[0], len(seen), head_size)  # (B*Hkv, K', D)
        grad_value = torch.zeros_like(grad_key)  # (B*Hkv, K', D)
        # Summed in float64: each is a sum of ds * distance over every score, where ds
        # cancels (each row's sums to 0) and the distances grow with the length.
        grad_slopes = None
        if grad_alibi is not None:
            grad_slopes = torch.zeros_like(grad_alibi, dtype=torch.float64)
        # Everything per block is kept keys-first, (C, R): probsᵀ, dsᵀ and dqᵀ.
        for rows in blocks:
            row_residue = row_spread = None
            if residue is not None:  # (B*Hkv, R*G)
                row_residue = residue.new_zeros(value.shape[0], len(rows) * walk.group)
            if spread is not None:
                row_spread = spread.new_zeros(walk.batch, kv_heads, len(rows), walk.group)
            q_block = walk.rows(folded, rows)  # (B, Hkv, R, D [+ 1])
            q_plain = _as_3d(q_block[..., :head_size])  # (B*Hkv, R, D), scale * unit * q
            shift_row = _as_3d(walk.rows(shift, rows)).transpose(1, 2)  # (B*Hkv, 1, R)
            do_block = _as_3d(walk.rows(grad_folded, rows))  # (B*Hkv, R, D)
            delta_row = _as_3d(walk.rows(delta, rows)).transpose(1, 2)  # (B*Hkv, 1, R)
            dq_t = q_plain.new_zeros(q_plain.shape[0], head_size, len(rows) * walk.group)
            # dq_t: (B*Hkv, D, R)
            for columns in walk.key_blocks(rows):
                keys_here = slice(columns.start, columns.stop)
                mine = slice(columns.start - seen.start, columns.stop - seen.start)  # in the buffer
                products = walk.tile("products", value.shape[0], len(columns), head_size)
                size_t = (value.shape[0], len(columns), len(rows) * walk.group)
                # As the forward formed the tile (whole scores, then minus the shift) wherever
                # that costs no extra pass: its probabilities are then the forward's.
                rebased = not fused or (rows.start, columns.start) in lse.rebased
                if rebased:
                    whole = walk.rows(whole_queries, rows)[..., :head_size]
                    scores = walk.scores(whole, rows, columns, keys=whole_keys)  # (…, R, C)
                    probs_t = torch.sub(
                        scores.transpose(1, 2), shift_row, out=walk.tile("scores_t", *size_t)
                    )  # (B*Hkv, C, R)
                else:  # the shift in the matmul: keys first, no pass over the tile
                    probs_t = walk.scores(q_block, rows, columns, transposed=True)  # (…, C, R)
                units.exp_(probs_t)  # exp(score - shift): probabilities times total
                grad_value[:, mine] += torch.bmm(probs_t, do_block, out=products)
                grad_scores_t = torch.bmm(
                    value[:, keys_here], do_block.transpose(1, 2),
                    out=walk.tile("grad_t", *probs_t.shape),
                )  # (B*Hkv, C, R), d loss / d probsᵀ  # fmt: skip
                grad_scores_t.sub_(delta_row).mul_(probs_t)  # d loss / d scoresᵀ
                if grad_mask is not None:
                    grad_mask[:, :, rows.start : rows.stop, :, keys_here] = walk.unfold_tile(
                        grad_scores_t, rows, columns, transposed=True
                    )
                if row_residue is not None:
                    row_residue += grad_scores_t.sum(dim=1, dtype=torch.float64)
                far = None
                if grad_alibi is not None or row_spread is not None:
                    far = walk.distance(rows, columns).unsqueeze(1)  # (R, 1, C)
                if grad_alibi is not None:  # the bias is -slope * distance
                    tile = walk.unfold_tile(grad_scores_t, rows, columns, transposed=True)
                    grad_slopes -= _row_sums(tile, far).sum(dim=2)  # (B, Hkv, G)
                if row_spread is not None:  # sum of exp(score - shift) * distance
                    weights = walk.unfold_tile(probs_t, rows, columns, transposed=True)
                    row_spread += _row_sums(weights, far)
                if softcap is not None:  # through the cap: d tanh = 1 - tanh²
                    tanh = walk.tanh.transpose(1, 2) if rebased else walk.tanh  # (…, C, R)
                    grad_scores_t.mul_(tanh.square_().neg_().add_(1.0))
                grad_key[:, mine] += torch.bmm(grad_scores_t, q_plain, out=products)
                dq_t.baddbmm_(key_t[:, :, keys_here], grad_scores_t)
            grad_query[:, :, rows.start : rows.stop] = dq_t.transpose(1, 2).view(
                walk.batch, kv_heads, len(rows), walk.group, head_size
            )
            here = slice(rows.start, rows.stop)
            if row_residue is not None:  # runs own their rows: no two threads write one
                residue[:, :, here] += row_residue.view(residue[:, :, here].shape)
            if row_spread is not None:  # probabilities: over each row's total
                spread[:, :, here] += row_spread * inverse[:, :, here, :, 0]
        return seen, grad_key, grad_value, grad_slopes

    parts = parallel_map(attend, walk.groups(), query.device)
    if len(parts[0][0]) == walk.k_len:  # the first run saw every key: it takes the rest
        (_, grad_key, grad_value, _), rest = parts[0], parts[1:]
    else:
        grad_key, grad_value, rest = torch.zeros_like(value), torch.zeros_like(value), parts
    for seen, part_key, part_value, _ in rest:  # added in a fixed order
        grad_key[:, seen.start : seen.stop] += part_key
        grad_value[:, seen.start : seen.stop] += part_value
    for *_, part_slopes in parts:
        if part_slopes is not None:
            grad_alibi += part_slopes
    kv_shape = (walk.batch, kv_heads, walk.k_len, head_size)
    grad_key, grad_value = grad_key.view(kv_shape), grad_value.view(kv_shape)
    # grad_key was taken against scale * unit * q; dividing by the unit brings it to scale * q.
    return unfold_heads(grad_query.mul_(scale)), grad_key.div_(units.unit), grad_value


def sink_share(rows: RowStats, sinks: Tensor | None) -> Tensor | float:
    """Each row's mass that the sink takes, ``p = exp(sink - shift) / total``, ``(B, H, Q)``
    float64 (0 without sinks, and where nothing at all was summed: a -inf sink, no key)."""
    if sinks is None:
        return 0.0
    logits = sinks.double().view(1, -1, 1) * rows.units.unit  # (1, H, 1), units
    taken = rows.units.exp_(logits - rows.shift.double()) / rows.total.double()  # (B, H, Q)
    return taken.masked_fill_(rows.total == 0, 0.0)


def sink_gradient(share: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sinks ``(H,)``. A sink takes ``share`` of each row's mass
    (:func:`sink_share`) and gives no value, so ``d out / d sink = -share * out`` and the
    gradient is ``-sum share * delta`` over batch and rows, with ``delta = rowsum(grad_out *
    out)``; summed in float64."""
    return -(share * delta.double()).sum(dim=(0, 2))


def delta_error(residue: Tensor, delta: Tensor, share: Tensor | float) -> Tensor:
    """How far the ``delta`` a backward used falls short of each row's true ``sum p * dp``,
    ``(B, H, Q)`` float64, from the ``residue`` its ``ds`` left (folded, as
    :func:`attend_backward` fills it). Over the keys, whose probabilities sum to ``1 - share``,
    ``sum ds = true - used * (1 - share)``, so ``true - used = residue - used * share``."""
    return unfold_heads(residue) - delta.double() * share


def slope_gradient(grad_folded: Tensor, slopes: Tensor) -> Tensor:
    """The slopes' gradient summed as ``(B, Hkv, G)`` by the backward, in the slopes' own shape
    (``(H,)`` or ``(B, H)``) and dtype."""
    full = slopes.view(-1, grad_folded.shape[1] * grad_folded.shape[2]).shape  # (1 or B, H)
    return grad_folded.flatten(1).sum_to_size(full).view(slopes.shape).to(slopes.dtype)


def _fold_slopes(slopes: Tensor | None, kv_heads: int) -> Tensor | None:
    """ALiBi slopes ``(H,)`` or ``(B, H)`` as ``(B|1, Hkv, 1, G, 1)`` to match folded tiles."""
    if slopes is None:
        return None
    return slopes.view(-1, kv_heads, slopes.shape[-1] // kv_heads)[:, :, None, :, None]


def merge(out: Tensor, lse: Tensor, other_out: Tensor, other_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attentions of the same queries over disjoint keys, exactly.

    Each ``out (..., D)`` is normalised over its own keys with log-sum-exp ``lse (...)``; the
    result is attention over the union. Rows that saw nothing on one side take the other side.
    """
    total = torch.logaddexp(lse, other_lse)  # (...), -inf only where both are -inf
    safe = total.masked_fill(total == NEG_INF, 0.0)
    weight = (lse - safe).exp().unsqueeze(-1)  # (..., 1)
    other_weight = (other_lse - safe).exp().unsqueeze(-1)  # (..., 1)
    return out * weight + other_out * other_weight, total
