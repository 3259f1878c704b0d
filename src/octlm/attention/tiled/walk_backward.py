"""The block walk's backward (FlashAttention-2): each tile's probabilities recomputed from the
forward's row statistics, and the gradients of the inputs and the score modifiers."""

from __future__ import annotations

import torch
from torch import Tensor

from octlm.attention.tiled.core import (
    RowStats,
    Rules,
    accumulation_dtype,
    all_finite,
    as_3d,
    blockwise,
    fold,
    fold_keys,
    fold_rows,
    slope_moments,
    unfold_heads,
)
from octlm.attention.tiled.threads import parallel_map
from octlm.attention.tiled.walk import BlockWalk, rows_of

# The largest shift (in score units) the backward lets ride in the matmul: inside it, the
# shift's rounding joins the sum of products; past it, scores are formed first, as naive does.
FUSED_SHIFT_LIMIT = 64.0


def walk_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    stats: RowStats,
    delta: Tensor,
    rules: Rules,
    *,
    grad_mask: Tensor | None = None,
    residue: Tensor | None = None,
    moments: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward over the tiles of a :class:`BlockWalk`, as
    :func:`~octlm.attention.tiled.engine.attend_backward` describes it: per query block,
    ``dv += pᵀ dO``, ``ds = p (dO vᵀ - delta)``, ``dk += dsᵀ q`` and ``dq += ds k``, plus the
    score modifiers' extras (:func:`_modifiers`) and the ALiBi slopes' moments
    (:class:`_ExactTiles`)."""
    mask, scale, softcap, alibi_slopes = rules.mask, rules.scale, rules.softcap, rules.alibi_slopes
    dtype = accumulation_dtype(query.dtype)
    kv_heads, head_size = key.shape[1], query.shape[-1]
    units = stats.units
    float_mask = mask is not None and mask.is_floating_point()
    modified = softcap is not None or alibi_slopes is not None
    fused = not float_mask and not modified and bool(stats.shift.abs().max() <= FUSED_SHIFT_LIMIT)
    folded = fold(query, kv_heads, scale * units.unit, dtype, 0.0 if fused else None)
    shift = fold_rows(stats.shift, kv_heads, dtype)  # (B, Hkv, Q, G, 1), in units
    if fused:  # the extra column holds -shift, so the matmul yields scores - shift
        folded[..., head_size:] = -shift
    # p = exp(score - shift) / total. The 1 / total rides on grad_out and delta (rows that see
    # nothing get 0), so no pass over the tile divides: dv += e @ (do / total) and
    # ds = e * (v @ (do / total) - delta / total).
    total = fold_rows(stats.total, kv_heads, dtype)  # (B, Hkv, Q, G, 1)
    inverse = torch.where(total > 0, 1.0 / total, 0.0)
    keys = fold_keys(key, dtype, 1.0 if fused else None)  # (B, Hkv, K, D [+ 1])
    grad_folded = fold(grad_out, kv_heads, 1.0, dtype, None) * inverse  # (B, Hkv, Q, G, D)
    delta = fold_rows(delta, kv_heads, dtype) * inverse  # (B, Hkv, Q, G, 1)
    value = blockwise(value.to(dtype))  # (B, Hkv, K, D)
    # The forward's rebased tiles are formed again from operands laid out as its own were (with
    # or without the shift column), so that their scores are its scores to the last bit.
    plain_queries, plain_keys = folded, keys
    if stats.rebased and stats.shift_column != fused:
        column = 0.0 if stats.shift_column else None
        plain_queries = fold(query, kv_heads, scale * units.unit, dtype, column)
        plain_keys = fold_keys(key, dtype, None if column is None else 1.0)
    walk = BlockWalk(folded, keys, rules, units, careful=stats.careful, keep_tanh=True)
    # Keys as (B*Hkv, D, K), so dqᵀ += keysᵀ @ dsᵀ has no transposed first operand.
    key_t = as_3d(keys[..., :head_size].transpose(-2, -1).contiguous())  # (B*Hkv, D, K)
    value = as_3d(value)  # (B*Hkv, K, D)
    if not all_finite(key_t, value):  # one pass, O(K·D), against the backward's O(Q·K·D)
        # 0 x NaN is NaN: a key or value that no row sees must not reach a gradient through a
        # zero probability (the forward's output can be clean while one sits in padding). One
        # that a row sees still does, through its probabilities or through delta (that row's
        # output is NaN).
        key_t = key_t.masked_fill(~key_t.isfinite(), 0.0)
        value = value.masked_fill(~value.isfinite(), 0.0)
    grad_query = torch.empty_like(grad_folded)  # (B, Hkv, Q, G, D)
    exact = None if moments is None else _ExactTiles(query, key, value, grad_out, stats, rules)

    def attend(blocks: list[range]) -> tuple[range, Tensor, Tensor]:
        """The gradients from a run of query blocks; ``dk`` and ``dv`` summed over them into
        their own tensors, over the ``seen`` keys, so that runs can go on at once."""
        seen = walk.visited_keys(rows_of(blocks))
        grad_key = value.new_zeros(value.shape[0], len(seen), head_size)  # (B*Hkv, K', D)
        grad_value = torch.zeros_like(grad_key)  # (B*Hkv, K', D)
        # Everything per block is kept keys-first, (C, R): probsᵀ, dsᵀ and dqᵀ.
        for rows in blocks:
            row_residue = None
            if residue is not None:  # (B*Hkv, R*G)
                row_residue = residue.new_zeros(value.shape[0], len(rows) * walk.group)
            q_block = walk.rows(folded, rows)  # (B, Hkv, R, D [+ 1])
            q_plain = as_3d(q_block[..., :head_size])  # (B*Hkv, R, D), scale * unit * q
            shift_row = as_3d(walk.rows(shift, rows)).transpose(1, 2)  # (B*Hkv, 1, R)
            do_block = as_3d(walk.rows(grad_folded, rows))  # (B*Hkv, R, D)
            delta_row = as_3d(walk.rows(delta, rows)).transpose(1, 2)  # (B*Hkv, 1, R)
            dq_t = q_plain.new_zeros(q_plain.shape[0], head_size, len(rows) * walk.group)
            # dq_t: (B*Hkv, D, R)
            for columns in walk.key_blocks(rows):
                keys_here = slice(columns.start, columns.stop)
                mine = slice(columns.start - seen.start, columns.stop - seen.start)  # in the buffer
                products = walk.tile("products", value.shape[0], len(columns), head_size)
                size_t = (value.shape[0], len(columns), len(rows) * walk.group)
                # As the forward formed the tile (scores, then minus the shift) wherever
                # that costs no extra pass: its probabilities are then the forward's.
                rebased = not fused or (rows.start, columns.start) in stats.rebased
                if rebased:
                    plain = walk.rows(plain_queries, rows)[..., :head_size]
                    scores = walk.scores(plain, rows, columns, keys=plain_keys)  # (…, R, C)
                    probs_t = torch.sub(
                        scores.transpose(1, 2), shift_row, out=walk.tile("scores_t", *size_t)
                    )  # (B*Hkv, C, R)
                else:  # the shift in the matmul: keys first, no pass over the tile
                    probs_t = walk.scores(q_block, rows, columns, transposed=True)  # (…, C, R)
                units.exp_(probs_t)  # exp(score - shift): probabilities times total
                grad_value[:, mine] += torch.bmm(probs_t, do_block, out=products)
                grad_scores_t = torch.bmm(
                    value[:, keys_here],
                    do_block.transpose(1, 2),
                    out=walk.tile("grad_t", *probs_t.shape),
                )  # (B*Hkv, C, R), d loss / d probsᵀ
                grad_scores_t.sub_(delta_row).mul_(probs_t)  # d loss / d scoresᵀ
                _modifiers(walk, grad_scores_t, rows, columns, rebased, grad_mask, row_residue)
                grad_key[:, mine] += torch.bmm(grad_scores_t, q_plain, out=products)
                dq_t.baddbmm_(key_t[:, :, keys_here], grad_scores_t)
            grad_query[:, :, rows.start : rows.stop] = dq_t.transpose(1, 2).view(
                walk.batch, kv_heads, len(rows), walk.group, head_size
            )
            here = slice(rows.start, rows.stop)
            if row_residue is not None:  # runs own their rows: no two threads write one
                residue[:, :, here] += row_residue.view(residue[:, :, here].shape)
            if exact is not None:  # (B, Hkv, G, R, 4)
                moments.unflatten(1, (kv_heads, -1))[:, :, :, here] += exact.moments(rows)
        return seen, grad_key, grad_value

    parts = parallel_map(attend, walk.groups(), query.device)
    if len(parts[0][0]) == walk.k_len:  # the first run saw every key: it takes the rest
        (_, grad_key, grad_value), rest = parts[0], parts[1:]
    else:
        grad_key, grad_value, rest = torch.zeros_like(value), torch.zeros_like(value), parts
    for seen, part_key, part_value in rest:  # added in a fixed order
        grad_key[:, seen.start : seen.stop] += part_key
        grad_value[:, seen.start : seen.stop] += part_value
    kv_shape = (walk.batch, kv_heads, walk.k_len, head_size)
    grad_key, grad_value = grad_key.view(kv_shape), grad_value.view(kv_shape)
    # grad_key was taken against scale * unit * q; dividing by the unit brings it to scale * q.
    return unfold_heads(grad_query.mul_(scale)), grad_key.div_(units.unit), grad_value


def _modifiers(
    walk: BlockWalk,
    grad_scores_t: Tensor,
    rows: range,
    columns: range,
    rebased: bool,
    grad_mask: Tensor | None,
    row_residue: Tensor | None,
) -> None:
    """One tile's extras beyond FlashAttention-2's steps, on ``grad_scores_t (B*Hkv, C, R*G)``:
    the float mask's gradient (the scores'), what ``ds`` sums to per row (the sinks' residue),
    and ``ds`` carried through the softcap (``d tanh = 1 - tanh²``), in place."""
    if grad_mask is not None:
        tile = walk.unfold_tile(grad_scores_t, rows, columns, transposed=True)
        grad_mask[:, :, rows.start : rows.stop, :, columns.start : columns.stop] = tile
    if row_residue is not None:  # (B*Hkv, R*G)
        row_residue += grad_scores_t.sum(dim=1, dtype=torch.float64)
    if walk.cap is not None:
        tanh = walk.tanh.transpose(1, 2) if rebased else walk.tanh  # (B*Hkv, C, R*G)
        grad_scores_t.mul_(tanh.square_().neg_().add_(1.0))


class _ExactTiles:
    """A walk's tiles formed again in float64, for the ALiBi slopes' moments (why: docs/design.md,
    'The numerics of the tiled core')."""

    def __init__(self, query, key, value, grad_out, rows: RowStats, rules: Rules):
        kv_heads, dtype = key.shape[1], torch.float64
        self.queries = fold(query, kv_heads, rules.scale * rows.units.unit, dtype, None)
        self.walk = BlockWalk(self.queries, fold_keys(key, dtype, None), rules, rows.units,
                              careful=rows.careful)  # fmt: skip
        self.shift = fold_rows(rows.shift, kv_heads, dtype)  # (B, Hkv, Q, G, 1), in units
        self.grad_out = fold(grad_out, kv_heads, 1.0, dtype, None)  # (B, Hkv, Q, G, D)
        values = as_3d(blockwise(value.to(dtype)))  # (B*Hkv, K, D)
        self.values = values.masked_fill(~values.isfinite(), 0.0)

    def moments(self, rows: range) -> Tensor:
        """The :func:`~octlm.attention.tiled.core.slope_moments` of ``rows`` over every key
        they see, ``(B, Hkv, G, R, 4)``."""
        walk = self.walk
        queries, grad_out = walk.rows(self.queries, rows), as_3d(walk.rows(self.grad_out, rows))
        shift = as_3d(walk.rows(self.shift, rows))  # (B*Hkv, R*G, 1)
        found = self.queries.new_zeros(walk.batch, walk.kv_heads, len(rows), walk.group, 4)
        for columns in walk.key_blocks(rows):
            scores = walk.scores(queries, rows, columns)  # (B*Hkv, R*G, C)
            weights = walk.units.exp_(scores.sub_(shift))  # exp(score - shift)
            values = self.values[:, columns.start : columns.stop]  # (B*Hkv, C, D)
            grad_probs = torch.bmm(grad_out, values.transpose(1, 2))  # (B*Hkv, R*G, C)
            far = walk.distance(rows, columns).unsqueeze(1)  # (R, 1, C)
            found += slope_moments(
                walk.unfold_tile(weights, rows, columns, transposed=False),
                walk.unfold_tile(grad_probs, rows, columns, transposed=False),
                far,
            )  # (B, Hkv, R, G, 4)
        return found.transpose(2, 3)
