"""FlashAttention's blocking in plain PyTorch: online softmax forward, recomputing backward.

The seed's sketch, grown up. Queries and keys are both cut into blocks; for each query block
the running maximum, running sum and unnormalised output are carried across key blocks, and the
output is normalised once at the end. Key blocks that the causal/window rules hide from a whole
query block are never visited; blocks they show whole get no mask arithmetic; only the edge
blocks build an element mask, for that block alone. No ``q_len x k_len`` tensor is ever made.

The backward (FlashAttention-2) saves only query, key, value, output and the log-sum-exp, and
recomputes each block's probabilities as ``exp(scores - lse)``.

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
# How far (base 2) the running maximum may rise above a row's shift before the shift follows.
SLACK = 8.0
# Rows and keys per tile. Tuned on a 2-core CPU at 8,192 tokens, 8 heads of 32: smaller tiles
# pay Python overhead per block, larger ones fall out of cache.
DEFAULT_BLOCK = (256, 512)
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

    ``query`` (B, Hkv, Q, G, D + 1) and ``key`` (B, Hkv, K, D + 1) carry one extra column each
    (see :func:`_fold`); ``mask`` is as :func:`_fold_mask` returns. ``past`` places query row
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
        self.query, self.key = query, key
        self._buffers: dict[str, Tensor] = {}

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

    def tile(self, name: str, rows: range, columns: range) -> Tensor:
        """A reused (B*Hkv, R*G, C) buffer for one block of scores."""
        shape = (self.batch * self.kv_heads, len(rows) * self.group, len(columns))
        numel = shape[0] * shape[1] * shape[2]
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[name] = self.key.new_empty(numel)
        return buffer[:numel].view(shape)

    def scores(self, q_block: Tensor, rows: range, columns: range) -> tuple[Tensor, bool]:
        """``q_block @ key_blockᵀ`` with hidden places at -inf; True when any could be hidden."""
        k_block = self.key[:, :, columns.start : columns.stop]  # (B, Hkv, C, D + 1)
        scores = torch.bmm(
            _as_3d(q_block), _as_3d(k_block).transpose(1, 2), out=self.tile("scores", rows, columns)
        )  # (B*Hkv, R*G, C)
        whole = fully_visible(rows, columns, self.past, self.causal, self.window)
        padded = columns.stop > self.shortest
        if whole and not padded and self.mask is None:
            return scores, False
        tile = scores.view(self.batch, self.kv_heads, len(rows), self.group, len(columns))
        if not whole:
            visible = allowed(rows, columns, self.past, self.causal, self.window, scores.device)
            tile.masked_fill_(~visible[:, None, :], NEG_INF)  # (R, 1, C) over the group
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
        return scores, True


def _fold(x: Tensor, kv_heads: int, scale: float, dtype: torch.dtype, extra: float | None):
    """(B, H, L, D) -> (B, Hkv, L, G, D [+ 1]) contiguous, times ``scale``, in ``dtype``.

    With ``extra`` the last dimension gains one column of that value. For keys it is 1, and
    for queries it holds each row's shift, so one matmul gives ``scores - shift`` and the
    subtraction costs no pass over the tile.
    """
    batch, heads, length, head_size = x.shape
    folded = x.view(batch, kv_heads, heads // kv_heads, length, head_size).transpose(2, 3)
    if extra is None:
        return (folded.to(dtype) * scale).contiguous()
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
    set from each row's first visible block and moves up only when a later block's maximum
    exceeds it by more than ``SLACK`` (weights stay below ``2**SLACK``, far from overflow).
    Most blocks therefore skip the rescale, and for long query blocks the shift rides in an
    extra query column (keys get a column of ones), so the matmul itself subtracts it.
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
        q_block = walk.rows(folded, rows)  # (B, Hkv, R, D [+ 1]); fused: last column = -shift
        shift = q_block.new_zeros(walk.batch * kv_heads, q_block.shape[2], 1)  # (B*Hkv, R, 1)
        running_sum = torch.zeros_like(shift)  # sum over keys of exp2(score - shift)
        acc = shift.new_zeros(*shift.shape[:-1], head_size)  # (B*Hkv, R, D), unnormalised
        unset = True  # some rows have not seen a key yet, so their shift is a placeholder
        for columns in walk.key_blocks(rows):
            scores, _ = walk.scores(q_block, rows, columns)  # (B*Hkv, R, C)
            if not fused:
                scores.sub_(shift)
            block_max = scores.amax(dim=-1, keepdim=True)  # (B*Hkv, R, 1), relative to shift
            if unset or block_max.max() > SLACK:
                # Rows seeing their first keys take that block's maximum as their shift; rows
                # whose maximum outgrew the shift move up to it. exp2(-step) rescales the sums.
                step = block_max.clamp(min=0.0)
                correction = step.neg().exp2_()
                if unset:  # a shift moving down could overflow exp2(-step); nothing to rescale
                    empty = running_sum == 0
                    step = torch.where(
                        empty, block_max.masked_fill(block_max == NEG_INF, 0.0), step
                    )
                    correction.masked_fill_(empty, 1.0)
                scores.sub_(step)
                running_sum.mul_(correction)
                acc.mul_(correction)
                shift += step
                if fused:
                    q_block[..., head_size:] = -shift.view(*q_block.shape[:-1], 1)
            weights = scores.exp2_()  # (B*Hkv, R, C), in place of the scores
            running_sum += weights.sum(dim=-1, keepdim=True)
            acc.baddbmm_(weights, _as_3d(value[:, :, columns.start : columns.stop]))
            if unset:
                unset = bool((running_sum == 0).any())
        acc.div_(torch.where(running_sum > 0, running_sum, 1.0))
        shape = (walk.batch, kv_heads, len(rows), walk.group)
        out[:, :, rows.start : rows.stop] = acc.view(*shape, head_size)
        lse[:, :, rows.start : rows.stop] = ((shift + running_sum.log2()) * LN2).view(shape)
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
    grad_query = torch.zeros_like(grad_folded)  # (B, Hkv, Q, G, D)
    grad_key = torch.zeros_like(value)  # (B, Hkv, K, D), in units of folded queries
    grad_value = torch.zeros_like(value)  # (B, Hkv, K, D)

    for rows in walk.query_blocks():
        q_block = walk.rows(folded, rows)  # (B, Hkv, R, D + 1)
        q_plain = _as_3d(q_block[..., :head_size])  # (B*Hkv, R, D), scale * log2(e) * q
        do_block = _as_3d(walk.rows(grad_folded, rows))  # (B*Hkv, R, D)
        delta_block = _as_3d(walk.rows(delta, rows))  # (B*Hkv, R, 1)
        dq_block = _as_3d(walk.rows(grad_query, rows))  # (B*Hkv, R, D)
        for columns in walk.key_blocks(rows):
            keys = slice(columns.start, columns.stop)
            k_block = _as_3d(ones[:, :, keys, :head_size])  # (B*Hkv, C, D)
            v_block = _as_3d(value[:, :, keys])  # (B*Hkv, C, D)
            scores, _ = walk.scores(q_block, rows, columns)  # (B*Hkv, R, C), minus lse
            probs = scores.exp2_()  # (B*Hkv, R, C)
            _as_3d(grad_value[:, :, keys]).baddbmm_(probs.transpose(1, 2), do_block)
            grad_scores = torch.bmm(
                do_block, v_block.transpose(1, 2), out=walk.tile("grad_scores", rows, columns)
            )  # (B*Hkv, R, C)
            grad_scores.sub_(delta_block).mul_(probs)
            dq_block.baddbmm_(grad_scores, k_block)
            _as_3d(grad_key[:, :, keys]).baddbmm_(grad_scores.transpose(1, 2), q_plain)
            if grad_mask is not None:
                grad_mask[:, :, rows.start : rows.stop, :, keys] = grad_scores.view(
                    walk.batch, kv_heads, len(rows), walk.group, len(columns)
                )
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
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    *,
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
        kernel: ``"auto"`` runs the Triton kernel (:mod:`octlm.attention.triton_flash`) for
            CUDA tensors when Triton is installed and no ``mask``/``key_lengths`` is given,
            and the plain-PyTorch blocks otherwise; ``"pytorch"`` or ``"triton"`` force one.

    Returns:
        The output in the input dtype (rows that see no key are zero), or ``(out, lse)``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
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
    options = dict(
        past=shape.past, causal=causal, window=window, scale=shape.scale, block=parse_block(block)
    )
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
