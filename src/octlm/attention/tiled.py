"""FlashAttention's blocking in plain PyTorch: online softmax forward, recomputing backward.

The seed's sketch, grown up. Queries and keys are both cut into blocks; for each query block
a per-row shift (the seed's running maximum, see :func:`attend_forward`), the running sum and
the unnormalised output are carried across key blocks, and the output is normalised once at
the end. Key blocks that the causal/window rules hide from a whole
query block are never visited; blocks they show whole get no mask arithmetic; only the edge
blocks build an element mask, for that block alone. No ``q_len x k_len`` tensor is ever made.

The backward (FlashAttention-2) saves only query, key, value, output and the log-sum-exp (and
the caller's own mask or key lengths, if any), and recomputes each block's probabilities as
``exp(scores - lse)``.

Layout inside: the query heads that share one key/value head are folded into the rows of a
block, ``(B, Hkv, Q, G, D) -> (B, Hkv, Q*G, D)``, so GQA costs one matmul per block with no copy
of key or value. ``G = heads // kv_heads``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from octlm.attention.inputs import check_inputs
from octlm.attention.masks import allowed, fully_visible, key_range, padding_mask

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The most one block's weights may sum to (relative to the row's shift) before the shift
# moves up to that block's maximum and the block is redone.
CEILING = 2.0**16
# Rows and keys per tile. Tuned on a 2-core CPU at 8,192 tokens, 8 heads of 32: smaller tiles
# pay Python overhead per block, larger ones fall out of cache.
DEFAULT_BLOCK = (512, 256)
# Query rows per block (heads of a group included) from which the shift rides in the matmul.
FUSED_SHIFT_ROWS = 64


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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Blocks:
    """The block walk shared by forward and backward, over inputs in the folded layout.

    ``query`` (B, Hkv, Q, G, D [+ 1]) and ``key`` (B, Hkv, K, D [+ 1]) may carry one extra column
    each (see :func:`_fold`); ``mask`` is as :func:`_fold_mask` returns. ``past`` places query row
    ``i`` at key position ``past + i``. Score tiles are written into one reused buffer: a fresh
    multi-MiB tensor per block costs page faults comparable to the matmul itself.
    """

    def __init__(self, query, key, past, causal, window, mask, block, key_lengths=None):
        self.batch, self.kv_heads, self.q_len, self.group, _ = query.shape
        self.k_len = key.shape[2]
        # Padding: keys past the longest length are skipped, keys before the shortest are
        # whole; only blocks in between need the per-batch mask.
        self.key_lengths = key_lengths
        self.longest, self.shortest = self.k_len, self.k_len
        if key_lengths is not None:
            self.longest, self.shortest = int(key_lengths.max()), int(key_lengths.min())
        self.past, self.causal, self.window, self.mask = past, causal, window, mask
        self.block_q, self.block_k = block
        # Decoding and short chunks: widen the key block so the score tile, not the Python
        # loop, sets the cost; the tile stays at most block_q x block_k per group.
        if self.q_len < self.block_q:
            self.block_k = self.block_k * self.block_q // max(self.q_len, 1)
        self.key = key
        self._buffers: dict[str, Tensor] = {}
        self._edges: dict[tuple[int, int, int], Tensor] = {}

    def query_blocks(self):
        for start in range(0, self.q_len, self.block_q):
            yield range(start, min(start + self.block_q, self.q_len))

    def key_blocks(self, rows: range):
        keys = key_range(rows, self.longest, self.past, self.causal, self.window)
        for start in range(keys.start, keys.stop, self.block_k):
            yield range(start, min(start + self.block_k, keys.stop))

    def rows(self, tensor: Tensor, rows: range) -> Tensor:
        """One query block of a folded (B, Hkv, Q, G, C) tensor as (B, Hkv, R * G, C)."""
        part = tensor[:, :, rows.start : rows.stop]
        return part.view(self.batch, self.kv_heads, len(rows) * self.group, tensor.shape[-1])

    def tile(self, name: str, *shape: int) -> Tensor:
        """A reused buffer of ``shape`` (contiguous), one per ``name``."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = self.key.new_empty(numel)
        return buffer[:numel].view(shape)

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
                self.key.device,
            )  # fmt: skip
            bias = torch.zeros(visible.shape, dtype=self.key.dtype, device=self.key.device)
            self._edges[key] = bias.masked_fill_(~visible, NEG_INF)
        return self._edges[key]

    def scores(
        self, q_block: Tensor, rows: range, columns: range, transposed: bool = False
    ) -> Tensor:
        """``q_block @ key_blockᵀ`` with hidden places at -inf.

        ``(B*Hkv, R*G, C)``, or ``(B*Hkv, C, R*G)`` when ``transposed``: the backward wants the
        keys first, because a transposed first operand takes a slow matmul path on CPU.
        """
        k_block = _as_3d(self.key[:, :, columns.start : columns.stop])  # (B*Hkv, C, D + 1)
        q_block = _as_3d(q_block)  # (B*Hkv, R*G, D + 1)
        size = (self.batch * self.kv_heads, q_block.shape[1], k_block.shape[1])
        if transposed:
            tile = self.tile("scores_t", size[0], size[2], size[1])
            scores = torch.bmm(k_block, q_block.transpose(1, 2), out=tile)  # (B*Hkv, C, R*G)
        else:
            tile = self.tile("scores", *size)
            scores = torch.bmm(q_block, k_block.transpose(1, 2), out=tile)  # (B*Hkv, R*G, C)
        whole = fully_visible(rows, columns, self.past, self.causal, self.window)
        padded = columns.stop > self.shortest
        if whole and not padded and self.mask is None:
            return scores
        tile = self.unfold_tile(scores, rows, columns, transposed)  # (B, Hkv, R, G, C) view
        if not whole:
            tile.add_(self._edge(rows, columns).unsqueeze(1))  # (R, 1, C) over the group
        if padded:
            present = padding_mask(self.key_lengths, columns)  # (B, 1, 1, C)
            tile.masked_fill_(~present.unsqueeze(1), NEG_INF)  # (B, 1, 1, 1, C)
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
                tile.add_(part.to(tile.dtype), alpha=LOG2E)  # the mask is in natural units
        return scores


def _fold(x: Tensor, kv_heads: int, scale: float, dtype: torch.dtype, extra: float | None):
    """(B, H, L, D) -> (B, Hkv, L, G, D [+ 1]) contiguous, times ``scale``, in ``dtype``.

    With ``extra`` the last dimension gains one column of that value. For keys it is 1, and
    for queries it holds each row's shift, so one matmul gives ``scores - shift`` and the
    subtraction costs no pass over the tile.
    """
    batch, heads, length, head_size = x.shape
    folded = x.view(batch, kv_heads, heads // kv_heads, length, head_size).transpose(2, 3)
    if extra is None:
        folded = folded.to(dtype)
        return (folded if scale == 1.0 else folded * scale).contiguous()  # keys: often no copy
    out = folded.new_empty(*folded.shape[:-1], head_size + 1, dtype=dtype)
    torch.mul(folded, scale, out=out[..., :head_size])
    out[..., head_size] = extra
    return out


def _unfold(rows: Tensor) -> Tensor:
    """(B, Hkv, Q, G, ...) -> (B, H, Q, ...): the inverse of the fold, for outputs."""
    batch, kv_heads, q_len, group = rows.shape[:4]
    return rows.transpose(2, 3).reshape(batch, kv_heads * group, q_len, *rows.shape[4:])


def _fold_mask(mask: Tensor | None, heads: int, kv_heads: int) -> Tensor | None:
    """A mask broadcastable to (B, H, Q, K) as (b, Hkv|1, Q|1, G|1, K|1) to match the fold."""
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (b, h, q, k)
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


class _Running:
    """The online softmax of one query block: per-row shift, running sum, unnormalised output.

    All base 2 and relative to ``shift``: ``running_sum = sum exp2(score - shift)`` and ``acc =
    sum exp2(score - shift) * value`` over the keys read so far. With ``fused`` the shift lives
    in the query block's extra column (as ``-shift``), so the score matmul subtracts it.
    """

    def __init__(self, walk: _Blocks, q_block: Tensor, rows: range, fused: bool, head_size: int):
        self.walk, self.q_block, self.rows, self.fused = walk, q_block, rows, fused
        self.shift = q_block.new_zeros(walk.batch * walk.kv_heads, q_block.shape[2], 1)
        self.running_sum = torch.zeros_like(self.shift)  # (B*Hkv, R, 1)
        self.acc = self.shift.new_zeros(*self.shift.shape[:-1], head_size)  # (B*Hkv, R, D)
        self.unset = True  # some rows have not seen a key yet: their shift is a placeholder

    def scores(self, columns: range) -> Tensor:
        """``(B*Hkv, R, C)`` scores of one key block minus the shift, hidden places -inf."""
        scores = self.walk.scores(self.q_block, self.rows, columns)
        return scores if self.fused else scores.sub_(self.shift)

    def rebase(self, scores: Tensor) -> None:
        """Move each row's shift up to this block's maximum (rows seeing their first keys: to
        it, up or down), rescaling what was summed by ``exp2(-step)``; ``scores`` follow."""
        block_max = scores.amax(dim=-1, keepdim=True)  # (B*Hkv, R, 1), relative
        step = block_max.clamp(min=0.0)
        correction = step.neg().exp2_()
        if self.unset:  # a shift moving down could overflow exp2(-step); nothing to rescale
            empty = self.running_sum == 0
            first = block_max.masked_fill(block_max == NEG_INF, 0.0)
            step = torch.where(empty, first, step)
            correction.masked_fill_(empty, 1.0)
        scores.sub_(step)
        self.running_sum.mul_(correction)
        self.acc.mul_(correction)
        self.shift.add_(step)
        if self.fused:
            self.q_block[..., -1:] = -self.shift.view(*self.q_block.shape[:-1], 1)

    def output(self) -> Tensor:
        """Normalised output ``(B*Hkv, R, D)``; rows that saw no key are 0."""
        seen = self.running_sum > 0
        return self.acc.div_(torch.where(seen, self.running_sum, 1.0))

    def lse(self) -> Tensor:
        """Natural log-sum-exp ``(B*Hkv, R, 1)``; -inf for rows that saw no key."""
        return (self.shift + self.running_sum.log2()) * LN2


def attend_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    past: int,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float,
    block: tuple[int, int] = DEFAULT_BLOCK,
    key_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over one chunk of keys: the forward block steps as a function.

    ``query (B, H, Q, D)``, ``key``/``value (B, Hkv, K, D)``; query row ``i`` sits at key
    position ``past + i`` of this chunk. Inputs are not validated here (the public functions do
    that). Returns ``out (B, H, Q, D)`` normalised, and ``lse (B, H, Q)``, both in the
    accumulation dtype; rows that see no key get ``out = 0`` and ``lse = -inf``. Two such
    partial results over disjoint key chunks combine exactly with :func:`merge`.

    Scores are kept in base 2 (``exp2`` is several times cheaper than ``exp`` on CPU). Softmax
    is invariant to a per-row shift, so the shift need not be the exact running maximum: it is
    set to the maximum of each row's first visible block, and moves up only when a later
    block's weights sum past ``CEILING`` (or overflow), in which case that block is redone. The
    usual block therefore costs no maximum pass and no rescale, and for long query blocks the
    shift rides in an extra query column (keys get a column of ones), so the matmul itself
    subtracts it. Weights never exceed ``CEILING``, far from float32 overflow, and scaling by
    the shift is exact whatever its value.
    """
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    rows_per_block = min(block[0], query.shape[2]) * (heads // kv_heads)
    # The fused shift costs a copy of the keys with a column of ones: worth it when each key
    # block meets many query rows, not when decoding one token against a long cache.
    fused = rows_per_block >= FUSED_SHIFT_ROWS
    extra = 0.0 if fused else None
    folded = _fold(query, kv_heads, scale * LOG2E, dtype, extra)  # (B, Hkv, Q, G, D [+ 1])
    key = _fold(key, kv_heads, 1.0, dtype, 1.0 if fused else None).squeeze(3)  # (B, Hkv, K, ·)
    value = value.to(dtype).contiguous()  # (B, Hkv, K, D)
    walk = _Blocks(
        folded, key, past, causal, window, _fold_mask(mask, heads, kv_heads), block, key_lengths
    )
    out = folded.new_empty(*folded.shape[:-1], head_size)  # (B, Hkv, Q, G, D)
    lse = folded.new_empty(folded.shape[:-1])  # (B, Hkv, Q, G), natural log

    for rows in walk.query_blocks():
        state = _Running(walk, walk.rows(folded, rows), rows, fused, head_size)
        for columns in walk.key_blocks(rows):
            scores = state.scores(columns)  # (B*Hkv, R, C), minus shift, base 2
            if state.unset:
                state.rebase(scores)
            weights = scores.exp2_()  # (B*Hkv, R, C), in place of the scores
            block_sum = weights.sum(dim=-1, keepdim=True)  # (B*Hkv, R, 1)
            if not bool(block_sum.max() <= CEILING):  # also catches inf
                # A score rose far above its row's shift: redo the block with the shift moved.
                scores = state.scores(columns)
                state.rebase(scores)
                weights = scores.exp2_()
                block_sum = weights.sum(dim=-1, keepdim=True)
            state.running_sum += block_sum
            state.acc.baddbmm_(weights, _as_3d(value[:, :, columns.start : columns.stop]))
            if state.unset:
                state.unset = bool((state.running_sum == 0).any())
        shape = (walk.batch, kv_heads, len(rows), walk.group)
        out[:, :, rows.start : rows.stop] = state.output().view(*shape, head_size)
        lse[:, :, rows.start : rows.stop] = state.lse().view(shape)
    return _unfold(out), _unfold(lse)


def attend_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    past: int,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float,
    block: tuple[int, int] = DEFAULT_BLOCK,
    key_lengths: Tensor | None = None,
    grad_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one query chunk against one key chunk: the backward block steps.

    ``lse`` and ``delta = rowsum(grad_out * out)`` are ``(B, H, Q)`` over *all* keys the
    queries attend to (global, when keys are split across calls or processes), so each chunk's
    probabilities ``exp(scores - lse)`` are exact. Returns ``dq (B, H, Q, D)`` and ``dk``/``dv
    (B, Hkv, K, D)`` in the accumulation dtype, summed over each GQA group. When ``grad_mask``
    (folded like the mask, full size) is given, the scores' gradient is written into it.
    """
    dtype = accumulation_dtype(query.dtype)
    heads, kv_heads, head_size = query.shape[1], key.shape[1], query.shape[-1]
    folded = _fold(query, kv_heads, scale * LOG2E, dtype, extra=0.0)  # (B, Hkv, Q, G, D + 1)
    # The extra column holds -lse (base 2), so the matmul yields scores - lse; rows that see
    # no key (lse = -inf) get -inf there, and probabilities exp2(-inf) = 0.
    lse2 = (lse.to(dtype) * LOG2E).neg_().masked_fill_(lse == NEG_INF, NEG_INF)
    folded[..., head_size] = _fold(lse2.unsqueeze(-1), kv_heads, 1.0, dtype, None)[..., 0]
    ones = _fold(key, kv_heads, 1.0, dtype, extra=1.0).squeeze(3)  # (B, Hkv, K, D + 1)
    grad_folded = _fold(grad_out, kv_heads, 1.0, dtype, None)  # (B, Hkv, Q, G, D)
    delta = _fold(delta.unsqueeze(-1), kv_heads, 1.0, dtype, None)  # (B, Hkv, Q, G, 1)
    value = value.to(dtype).contiguous()  # (B, Hkv, K, D)
    walk = _Blocks(
        folded, ones, past, causal, window, _fold_mask(mask, heads, kv_heads), block, key_lengths
    )
    # Keys as (B*Hkv, D, K), so dqᵀ += keysᵀ @ dsᵀ has no transposed first operand.
    key_t = _as_3d(ones[..., :head_size].transpose(-2, -1).contiguous())  # (B*Hkv, D, K)
    value = _as_3d(value)  # (B*Hkv, K, D)
    grad_query = torch.empty_like(grad_folded)  # (B, Hkv, Q, G, D)
    grad_key = torch.zeros_like(value)  # (B*Hkv, K, D), in units of folded queries
    grad_value = torch.zeros_like(value)  # (B*Hkv, K, D)

    # Everything per block is kept keys-first, (C, R): probsᵀ, dsᵀ and dqᵀ.
    for rows in walk.query_blocks():
        q_block = walk.rows(folded, rows)  # (B, Hkv, R, D + 1)
        q_plain = _as_3d(q_block[..., :head_size])  # (B*Hkv, R, D), scale * log2(e) * q
        do_block = _as_3d(walk.rows(grad_folded, rows))  # (B*Hkv, R, D)
        delta_row = _as_3d(walk.rows(delta, rows)).transpose(1, 2)  # (B*Hkv, 1, R)
        dq_t = q_plain.new_zeros(q_plain.shape[0], head_size, q_plain.shape[1])  # (B*Hkv, D, R)
        for columns in walk.key_blocks(rows):
            keys = slice(columns.start, columns.stop)
            products = walk.tile("products", value.shape[0], len(columns), head_size)
            probs_t = walk.scores(q_block, rows, columns, transposed=True)  # minus lse
            probs_t.exp2_()  # (B*Hkv, C, R)
            grad_value[:, keys] += torch.bmm(probs_t, do_block, out=products)
            grad_scores_t = torch.bmm(
                value[:, keys], do_block.transpose(1, 2), out=walk.tile("grad_t", *probs_t.shape)
            )  # (B*Hkv, C, R), d loss / d probsᵀ
            grad_scores_t.sub_(delta_row).mul_(probs_t)  # d loss / d scoresᵀ
            grad_key[:, keys] += torch.bmm(grad_scores_t, q_plain, out=products)
            dq_t.baddbmm_(key_t[:, :, keys], grad_scores_t)
            if grad_mask is not None:
                grad_mask[:, :, rows.start : rows.stop, :, keys] = walk.unfold_tile(
                    grad_scores_t, rows, columns, transposed=True
                )
        grad_query[:, :, rows.start : rows.stop] = dq_t.transpose(1, 2).view(
            walk.batch, kv_heads, len(rows), walk.group, head_size
        )
    kv_shape = (walk.batch, kv_heads, walk.k_len, head_size)
    grad_key, grad_value = grad_key.view(kv_shape), grad_value.view(kv_shape)
    # grad_key was taken against scale*log2(e)*q, so ln(2) brings it back to scale*q.
    return _unfold(grad_query.mul_(scale)), grad_key.mul_(LN2), grad_value


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


class _TiledAttention(torch.autograd.Function):
    """Autograd through the block steps; saves query, key, value, output and lse only."""

    @staticmethod
    def forward(ctx, query, key, value, mask, key_lengths, options):
        out, lse = attend_forward(query, key, value, mask=mask, key_lengths=key_lengths, **options)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse, mask, key_lengths)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse, mask, key_lengths = ctx.saved_tensors
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # (B, H, Q)
        grad_mask = None
        if mask is not None and ctx.needs_input_grad[3]:
            batch, heads, q_len, _ = query.shape
            kv_heads, k_len = key.shape[1], key.shape[2]
            grad_mask = lse.new_zeros(batch, kv_heads, q_len, heads // kv_heads, k_len)
        grad_query, grad_key, grad_value = attend_backward(
            query, key, value, grad_out, lse, delta, mask=mask, key_lengths=key_lengths,
            grad_mask=grad_mask, **ctx.options,
        )  # fmt: skip
        if grad_mask is not None:
            full = (1,) * (4 - mask.dim()) + tuple(mask.shape)
            grad_mask = _unfold(grad_mask).sum_to_size(full).view(mask.shape).to(mask.dtype)
        return (
            grad_query.to(query.dtype),
            grad_key.to(key.dtype),
            grad_value.to(value.dtype),
            grad_mask,
            None,
            None,
        )


def tiled_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_lengths: Tensor | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention with O(T) memory, by FlashAttention's blocking, on any PyTorch device.

    Args:
        query: ``(batch, heads, q_len, head_size)``.
        key, value: ``(batch, kv_heads, k_len, head_size)``; ``heads % kv_heads == 0`` and
            query head ``h`` reads key/value head ``h // (heads // kv_heads)``.
        block: ``(block_q, block_k)`` query rows and keys per tile, or one int for both. A
            performance choice, not a numerical one: the output changes only by rounding.
        causal: bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= k_len - q_len + i``.
        window: if > 0, a row also sees only the ``window`` most recent keys (itself included).
        mask: bool (True = may attend) or float (added to the scaled scores), broadcastable
            to ``(batch, heads, q_len, k_len)``; combined with causal/window by AND. A float
            mask that requires grad receives its gradient.
        scale: score scale, ``1 / sqrt(head_size)`` by default.
        dropout_p: must be 0; the tiled path has no attention dropout (use naive or sdpa).
        key_lengths: int ``(batch,)``: keys at and after ``key_lengths[b]`` are padding.
            Blocks past the longest length are skipped whole.
        return_lse: also return the log-sum-exp of the scaled scores, ``(batch, heads,
            q_len)``, fp32 (fp64 for fp64 inputs), ``-inf`` for rows that see no key.
        kernel: ``"auto"`` runs the Triton kernel (:mod:`octlm.attention.triton_flash`, which
            picks its own tiles) for CUDA tensors when Triton is installed, no ``mask`` or
            ``key_lengths`` is given, the dtype is not float64 and ``head_size <= 256``; the
            plain-PyTorch blocks otherwise. ``"pytorch"`` or ``"triton"`` force one.

    Returns:
        The output in the input dtype (rows that see no key are zero), or ``(out, lse)``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    block = parse_block(block)  # checked on every path, used by the PyTorch one
    if kernel == "triton" or (kernel == "auto" and _triton_fits(query, mask, key_lengths)):
        from octlm.attention.triton_flash import triton_attention

        return triton_attention(
            query, key, value, causal=causal, window=window, mask=mask, scale=scale,
            dropout_p=dropout_p, key_lengths=key_lengths, return_lse=return_lse,
        )  # fmt: skip
    shape = check_inputs(
        query, key, value, causal=causal, window=window, mask=mask, scale=scale,
        dropout_p=dropout_p, dropout_supported=False, key_lengths=key_lengths,
    )  # fmt: skip
    options = dict(past=shape.past, causal=causal, window=window, scale=shape.scale, block=block)
    out, lse = _TiledAttention.apply(query, key, value, mask, key_lengths, options)
    return (out, lse) if return_lse else out


KERNELS = ("auto", "pytorch", "triton")


def _triton_fits(query: Tensor, mask: Tensor | None, key_lengths: Tensor | None) -> bool:
    """Whether ``kernel="auto"`` should take the Triton kernel for these inputs."""
    if not isinstance(query, Tensor) or not query.is_cuda or mask is not None:
        return False
    if key_lengths is not None or query.dtype == torch.float64 or query.shape[-1] > 256:
        return False
    try:
        from octlm.attention.triton_flash import is_available
    except ImportError:
        return False
    return is_available(query.device)
