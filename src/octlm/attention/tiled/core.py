"""What the tiled forward and backward share: a call's :class:`Rules`, the :class:`Units`
scores are kept in, the :class:`RowStats` the forward leaves the backward, and the folded
layout.

Layout: the query heads that share one key/value head are folded into the rows of a block,
``(B, H, Q, D) -> (B, Hkv, Q, G, D)`` viewed as ``(B*Hkv, Q*G, D)`` per block, so GQA costs
one matmul per block with no copy of key or value. ``G = heads // kv_heads``. The numerics
(why a shift that is not the running maximum, why base 2, what is exact) are in
docs/design.md, 'The numerics of the tiled core'.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from octlm.attention.masks import as_4d
from octlm.attention.tiled.options import DEFAULT_BLOCK

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
# Score offsets (the sinks) from which scores are kept in natural units.
LARGE_OFFSET = 64.0


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Units:
    """The units scores are kept in: ``unit`` times natural units, exponentiated in base
    ``e ** (1 / unit)``: base 2 by default, natural where a term joins the scores or the sinks are
    large (why: docs/design.md, 'The numerics of the tiled core')."""

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
    # The tiles, by (first row, first key), whose scores the forward formed unshifted and then
    # shifted (a rebase), and whether its operands carried the shift column: the backward
    # forms those tiles again from operands laid out the same way, so their probabilities are
    # the forward's bit for bit (a row whose only score is its shift gets exactly 1).
    rebased: frozenset[tuple[int, int]] = frozenset()
    shift_column: bool = False
    whole: bool = False  # the call was one tile (tiled/whole.py): so is its backward
    # The statistics are over this call's keys alone, so a backward may sum each row's delta
    # from its own tile; not so for rows that see keys beyond it (a ring's chunk).
    complete: bool = True

    def lse(self) -> Tensor:
        """Natural log-sum-exp; ``-inf`` for rows that see no key."""
        return (self.shift + self.units.log(self.total)) / self.units.unit

    @staticmethod
    def of_lse(lse: Tensor, rules: Rules, careful: bool, whole: bool) -> RowStats:
        """The statistics of rows that see keys beyond one chunk's, from their log-sum-exp
        ``lse (B, H, Q)`` over all of them: shifted by it, total 1. ``careful`` and ``whole``
        are the chunk's forward's record."""
        units = Units.choose(rules)
        seen = lse > NEG_INF
        shift = (lse * units.unit).masked_fill(~seen, 0.0)
        return RowStats(shift, seen.to(lse.dtype), units, careful, whole=whole, complete=False)


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


def block_steps(steps: Callable) -> Callable:
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


def fold(x: Tensor, kv_heads: int, scale: float, dtype: torch.dtype, extra: float | None):
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


def fold_keys(key: Tensor, dtype: torch.dtype, extra: float | None) -> Tensor:
    """Keys ``(B, Hkv, K, D [+ 1])`` in ``dtype`` for the block matmuls, with a column of
    ``extra`` when given (see :func:`fold`), copied only when that is needed."""
    if extra is None:
        return blockwise(key.to(dtype))
    head_size = key.shape[-1]
    out = key.new_empty(*key.shape[:-1], head_size + 1, dtype=dtype)
    out[..., :head_size] = key
    out[..., head_size] = extra
    return out


def blockwise(x: Tensor) -> Tensor:
    """``x (B, Hkv, K, D)`` itself when its rows are contiguous and batch and heads merge, as
    in a KV cache's view of its longer buffer; else a contiguous copy. The block matmuls need
    no more, and decoding one token should not copy the whole cache."""
    rows = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    return x if rows and x.stride(0) == x.stride(1) * x.shape[1] else x.contiguous()


def unfold_heads(rows: Tensor) -> Tensor:
    """(B, Hkv, Q, G, ...) -> (B, H, Q, ...): the inverse of the fold, for outputs."""
    batch, kv_heads, q_len, group = rows.shape[:4]
    return rows.transpose(2, 3).reshape(batch, kv_heads * group, q_len, *rows.shape[4:])


def fold_rows(x: Tensor, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """A per-row statistic (B, H, Q) as (B, Hkv, Q, G, 1), to sit beside folded queries."""
    return fold(x.unsqueeze(-1), kv_heads, 1.0, dtype, None)


def fold_mask(mask: Tensor | None, heads: int, kv_heads: int) -> Tensor | None:
    """A mask broadcastable to (B, H, Q, K) as (b, Hkv|1, Q|1, G|1, K|1) to match the fold."""
    if mask is None:
        return None
    mask = as_4d(mask)  # (b, h, q, k)
    if mask.shape[1] == 1:
        return mask.unsqueeze(3)  # (b, 1, q, 1, k)
    batch, _, q_len, k_len = mask.shape
    return mask.view(batch, kv_heads, heads // kv_heads, q_len, k_len).transpose(2, 3)


def as_3d(x: Tensor) -> Tensor:
    """(B, Hkv, R, C) -> (B*Hkv, R, C) view, for the batched matmuls.

    A view, never a copy: the in-place matmuls write through it. The callers keep their
    tensors contiguous, so slicing rows or keys keeps the first two dims mergeable.
    """
    return x.view(-1, *x.shape[-2:]) if x.dim() == 4 else x


def all_finite(*tensors: Tensor | None) -> bool:
    """Whether the NaN-safe masking can be skipped, for a caller with no forward to ask.

    A finite sum says every element is finite in one pass (a NaN or infinity makes the sum
    NaN or infinite); only a sum that is not finite, or that overflowed, is looked at whole.
    """
    return all(
        t is None
        or not t.is_floating_point()
        or bool(t.sum().isfinite())
        or bool(t.isfinite().all())
        for t in tensors
    )


def fold_slopes(slopes: Tensor | None, kv_heads: int) -> Tensor | None:
    """ALiBi slopes ``(H,)`` or ``(B, H)`` as ``(B|1, Hkv, 1, G, 1)`` to match folded tiles."""
    if slopes is None:
        return None
    return slopes.view(-1, kv_heads, slopes.shape[-1] // kv_heads)[:, :, None, :, None]


def slope_moments(weights: Tensor, grad_probs: Tensor, far: Tensor) -> Tensor:
    """One tile's share of each row's ALiBi moments, ``(..., 4)`` float64: the sums over its keys
    of ``e``, ``e * dp``, ``e * far`` and ``e * dp * far``, from float64 ``weights = exp(score -
    shift)`` and ``grad_probs = grad_out · value`` ``(..., C)`` and distances ``far``. Sums over
    disjoint keys add up; :func:`slope_gradient` turns a row's into its share of the gradient."""
    weighted = weights * far  # (..., C)
    sums = (weights, weights * grad_probs, weighted, weighted * grad_probs)
    return torch.stack([x.sum(dim=-1) for x in sums], dim=-1)  # (..., 4)


def slope_gradient(moments: Tensor, slopes: Tensor, sink: Tensor | None = None) -> Tensor:
    """d loss / d slopes, in the slopes' own shape (``(H,)`` or ``(B, H)``) and dtype, from each
    row's :func:`slope_moments` ``(B, H, Q, 4)`` (and its sink's ``exp(sink - shift)``,
    ``(B, H, Q)``, which joins the sum of weights).

    With ``p = e / Z``, the bias ``-slope * far`` moves the loss by ``-sum p (dp - delta) far``,
    where ``delta = sum p dp``: minus the covariance of ``dp`` and the distance under ``p``,
    ``-(sum e dp far - sum e dp * sum e far / Z) / Z``. Each row's is exact from its sums, so
    tiles, chunks and ranks add their moments and the division comes once.
    """
    total, grad_probs, far, both = moments.unbind(dim=-1)  # (B, H, Q) each
    if sink is not None:
        total = total + sink
    total = total.masked_fill(total == 0, 1.0)  # rows that see nothing have no moments
    per_row = (both - grad_probs * far / total) / total  # (B, H, Q)
    full = slopes.view(-1, slopes.shape[-1]).shape  # (1 or B, H)
    return (-per_row.sum(dim=-1)).sum_to_size(full).view(slopes.shape).to(slopes.dtype)


def sink_share(rows: RowStats, sinks: Tensor) -> Tensor:
    """Each row's mass that the sink takes, ``p = exp(sink - shift) / total``, ``(B, H, Q)``
    float64 (0 where nothing at all was summed: a -inf sink, no key)."""
    logits = sinks.double().view(1, -1, 1) * rows.units.unit  # (1, H, 1), units
    taken = rows.units.exp_(logits - rows.shift.double()) / rows.total.double()  # (B, H, Q)
    return taken.masked_fill_(rows.total == 0, 0.0)


def sink_gradient(share: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sinks ``(H,)``. A sink takes ``share`` of each row's mass
    (:func:`sink_share`) and gives no value, so ``d out / d sink = -share * out`` and the
    gradient is ``-sum share * delta`` over batch and rows, with ``delta = rowsum(grad_out *
    out)``; summed in float64."""
    return -(share * delta.double()).sum(dim=(0, 2))


def delta_error(residue: Tensor, delta: Tensor, share: Tensor) -> Tensor:
    """How far the ``delta`` a backward used falls short of each row's true ``sum p * dp``,
    ``(B, H, Q)`` float64, from the ``residue`` its ``ds`` left (folded, as
    :func:`~octlm.attention.tiled.engine.attend_backward` fills it). Over the keys, whose
    probabilities sum to ``1 - share``, ``sum ds = true - used * (1 - share)``, so ``true -
    used = residue - used * share``."""
    return unfold_heads(residue) - delta.double() * share


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
